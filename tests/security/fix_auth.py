"""A policy file for the auth tests, with one principal per kind of grant, and their tokens."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from sokutatsu.core.auth import Policy, hash_token, read_policy

# Principal name -> its table in the policy file (without token_sha256, added per token below).
GRANTS: dict[str, str] = {
    "app": 'publish = ["t.*"]\nsubscribe = ["t.*"]\nenqueue = ["q.*"]\ndequeue = ["q.*"]',
    "other": 'publish = ["t.*"]\nsubscribe = ["t.*"]\nenqueue = ["q.*"]\ndequeue = ["q.*"]',
    "nobody": "",
    "admin": "admin = true",
    "svc": "service = true",
}


@dataclass(frozen=True)
class AuthFile:
    path: Path
    tokens: dict[str, str]  # principal -> its token
    policy: Policy

    def env(self, principal: str) -> dict[str, str]:
        """The environment of a process that enforces the policy and calls as ``principal``."""
        return {"SOKUTATSU_AUTH_FILE": str(self.path), "SOKUTATSU_AUTH_TOKEN": self.tokens[principal]}

    def metadata(self, principal: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.tokens[principal]}"),)


@pytest.fixture(scope="session")
def auth_file(tmp_path_factory: pytest.TempPathFactory) -> AuthFile:
    folder = tmp_path_factory.mktemp("auth")
    tokens = {name: f"token-of-{name}-0123456789" for name in GRANTS}
    tables = []
    for name, grants in GRANTS.items():
        tables.append(f'[principals.{name}]\ntoken_sha256 = ["{hash_token(tokens[name])}"]\n{grants}\n')
    # The development client certificate of `sokutatsu certs` is principal "app" too.
    tables[0] = tables[0].replace("[principals.app]\n", '[principals.app]\ncert_cn = ["sokutatsu-client"]\n')
    path = folder / "auth.toml"
    path.write_text("\n".join(tables))
    return AuthFile(path=path, tokens=tokens, policy=read_policy(path))


__all__ = ["AuthFile", "auth_file"]
