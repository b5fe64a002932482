"""``sokutatsu auth``: tokens and policy files for authentication (docs/security.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sokutatsu.core.auth import new_token, read_policy
from sokutatsu.core.cluster import FILE_VAR, load_secret, make_file, secret_file
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


def cluster_secret(
    file: Annotated[
        Path | None,
        typer.Option("--file", help=f"Where to keep it [default: {FILE_VAR}, else ~/.sokutatsu/cluster-secret]."),
    ] = None,
) -> None:
    """Make the cluster secret file if it is missing (mode 0600), check it, and print where it is.

    The services show the secret to each other on control RPCs (docs/security.md, The cluster secret);
    give every service of the cluster the same file (SOKUTATSU_CLUSTER_SECRET_FILE). The secret itself is
    never printed.
    """
    path = (file or secret_file()).expanduser()
    try:
        made = make_file(path)
        load_secret(create=False, environ={FILE_VAR: str(path)})
    except (SettingsError, OSError) as exc:
        typer.echo(f"sokutatsu: error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{'made' if made else 'kept'} {path}")
