"""``sokutatsu auth``: tokens and policy files for authentication (docs/security.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sokutatsu.core.auth import new_token, read_policy
from sokutatsu.core.settings import SettingsError


def auth_token() -> None:
    """Print a new random bearer token and the SHA-256 the policy file stores for it.

    Give the token to the client (SOKUTATSU_AUTH_TOKEN, or token= in the SDK) and put the hash in
    a principal's token_sha256 list in SOKUTATSU_AUTH_FILE; the servers never see the token stored.
    """
    token, digest = new_token()
    typer.echo(f"token:  {token}")
    typer.echo(f"sha256: {digest}")


def auth_check(
    file: Annotated[Path, typer.Argument(help="The policy file (TOML) to check.")],
) -> None:
    """Check a policy file as a service would at start, and list its principals."""
    try:
        policy = read_policy(file)
    except SettingsError as exc:
        typer.echo(f"sokutatsu: error: {exc}", err=True)
        raise typer.Exit(2) from None
    principals = {p.name: p for p in (*policy.by_token.values(), *policy.by_cn.values())}
    for name, principal in sorted(principals.items()):
        roles = [r for r, on in (("admin", principal.admin), ("service", principal.service)) if on]
        grants = [f"{k}={','.join(v)}" for k, v in principal.grants.items() if v]
        typer.echo(f"{name}: {' '.join(roles + grants) or '(no grants)'}")
