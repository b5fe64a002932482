"""The policy file: what it grants, what it refuses to load, and ``sokutatsu auth``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sokutatsu.core.auth import (
    ADMIN,
    PUBLISH,
    SERVICE,
    SUBSCRIBE,
    client_token,
    hash_token,
    matches,
    parse_policy,
    read_policy,
    server_policy,
)
from sokutatsu.core.settings import SettingsError

DIGEST = hash_token("t")
LIMIT_SECONDS = 30.0


def test_patterns_are_names_or_prefixes() -> None:
    assert matches("ticks", "ticks")
    assert not matches("ticks", "ticks2")
    assert matches("t.*", "t.a")
    assert matches("t.*", "t.")
    assert not matches("t.*", "u.a")
    assert matches("*", "anything")


def test_grants_roles_and_subscriber_ids() -> None:
    policy = parse_policy(
        {
            "principals": {
                "desk": {
                    "token_sha256": [DIGEST],
                    "publish": ["ticks"],
                    "subscribe": ["ticks.*"],
                    "subscriber_prefixes": ["desk-", "shared."],
                },
                "ops": {"cert_cn": ["ops.example"], "admin": True},
                "svc": {"token_sha256": [hash_token("s")], "service": True},
            }
        },
        "test",
    )
    desk = policy.by_token_value("t")
    assert desk is not None
    assert desk.name == "desk"
    assert desk.may(PUBLISH, "ticks")
    assert not desk.may(PUBLISH, "ticks.eu")
    assert desk.may(SUBSCRIBE, "ticks.eu")
    assert not desk.may(SUBSCRIBE, "ticks")
    assert desk.may(SUBSCRIBE)
    assert not desk.may(ADMIN)
    assert not desk.may(SERVICE)
    assert desk.owns("desk")
    assert desk.owns("desk-1")
    assert desk.owns("shared.x")
    assert not desk.owns("desktop")
    assert not desk.owns("ops-1")
    ops = policy.by_cn["ops.example"]
    assert ops.may(ADMIN)
    assert not ops.may(PUBLISH, "ticks")
    assert not ops.may(SERVICE)
    assert ops.owns("desk-1")  # an admin manages every subscription
    svc = policy.by_token_value("s")
    assert svc is not None
    assert svc.may(SERVICE)
    assert svc.may(PUBLISH, "x")
    assert svc.owns("desk-1")
    assert policy.by_token_value("nope") is None


@pytest.mark.parametrize(
    ("document", "says"),
    [
        ({}, "no [principals.<name>] table"),
        ({"users": {}}, "unknown table 'users'"),
        ({"principals": {"a": {"publish": ["x"]}}}, "has neither token_sha256 nor cert_cn"),
        ({"principals": {"a": {"token_sha256": ["abc"]}}}, "is not a SHA-256 in hex"),
        ({"principals": {"a": {"token_sha256": [DIGEST], "publsh": ["x"]}}}, "unknown key 'publsh'"),
        ({"principals": {"a": {"token_sha256": [DIGEST], "admin": "yes"}}}, "admin: expected true or false"),
        ({"principals": {"a": {"token_sha256": [DIGEST], "publish": [1]}}}, "expected a list of non-empty strings"),
        (
            {"principals": {"a": {"token_sha256": [DIGEST]}, "b": {"token_sha256": [DIGEST]}}},
            "is also a's",
        ),
    ],
)
def test_malformed_policies_are_one_line_errors(document: dict[str, object], says: str) -> None:
    with pytest.raises(SettingsError) as caught:
        parse_policy(document, "SOKUTATSU_AUTH_FILE='x'")
    assert says in str(caught.value)
    assert "\n" not in str(caught.value)


def test_files_and_environment(tmp_path: Path) -> None:
    path = tmp_path / "auth.toml"
    path.write_text(f'[principals.a]\ntoken_sha256 = ["{DIGEST}"]\npublish = ["*"]\n')
    assert server_policy({}) is None  # off by default
    policy = server_policy({"SOKUTATSU_AUTH_FILE": str(path)})
    assert policy is not None
    assert policy.by_token_value("t") is not None
    assert client_token({}) is None
    assert client_token({"SOKUTATSU_AUTH_TOKEN": "t"}) == "t"
    (tmp_path / "bad.toml").write_text("[principals.a\n")
    with pytest.raises(SettingsError, match="not valid TOML"):
        read_policy(tmp_path / "bad.toml")
    with pytest.raises(SettingsError, match="cannot read it"):
        read_policy(tmp_path / "missing.toml")
    with pytest.raises(SettingsError, match="SOKUTATSU_AUTH_FLIE"):
        server_policy({"SOKUTATSU_AUTH_FLIE": str(path)})


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sokutatsu.cli", *args],
        capture_output=True,
        text=True,
        timeout=LIMIT_SECONDS,
        check=False,
    )


def test_auth_token_prints_a_token_and_its_hash(tmp_path: Path) -> None:
    result = _cli("auth", "token")
    assert result.returncode == 0, result.stderr
    fields = dict(line.split(":", 1) for line in result.stdout.splitlines())
    token, digest = fields["token"].strip(), fields["sha256"].strip()
    assert len(token) >= 40
    assert hash_token(token) == digest
    path = tmp_path / "auth.toml"
    path.write_text(f'[principals.desk]\ntoken_sha256 = ["{digest}"]\nsubscribe = ["ticks"]\n')
    checked = _cli("auth", "check", str(path))
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.strip() == "desk: subscribe=ticks"


def test_a_service_with_an_unusable_policy_file_does_not_start(tmp_path: Path) -> None:
    (tmp_path / "auth.toml").write_text("[principals]\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith("SOKUTATSU_")}
    result = subprocess.run(
        [sys.executable, "-m", "sokutatsu.broker"],
        env={
            **base,
            "SOKUTATSU_BROKER_STATE_DIR": str(tmp_path / "state"),
            "SOKUTATSU_BROKER_LISTEN": "127.0.0.1:0",
            "SOKUTATSU_AUTH_FILE": str(tmp_path / "auth.toml"),
        },
        capture_output=True,
        text=True,
        timeout=LIMIT_SECONDS,
        check=False,
    )
    assert result.returncode == 2, result
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("sokutatsu-broker: error: SOKUTATSU_AUTH_FILE="), lines
    assert "no [principals.<name>] table" in lines[0]
