"""``sokutatsu certs``: the files it writes, their modes, and what the certificates say."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from sokutatsu.cli.certs import FILES

LIMIT_SECONDS = 60.0


def _sokutatsu(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SOKUTATSU_TLS_")}
    return subprocess.run(
        [sys.executable, "-m", "sokutatsu.cli", *args],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=LIMIT_SECONDS,
        check=False,
    )


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_certs_writes_a_ca_a_server_and_a_client_certificate(tmp_path: Path) -> None:
    out = tmp_path / "tls"
    result = _sokutatsu("certs", "--out", str(out), "--hosts", "127.0.0.1,localhost,broker-a", "--days", "30")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    for name in FILES:
        mode = (out / name).stat().st_mode & 0o777
        assert mode == (0o600 if name.endswith("-key.pem") else 0o644), (name, oct(mode))
    ca, server, client = _cert(out / "ca.pem"), _cert(out / "server.pem"), _cert(out / "client.pem")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for leaf in (server, client):
        leaf.verify_directly_issued_by(ca)
        assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        assert (leaf.not_valid_after_utc - leaf.not_valid_before_utc).days == 30
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert names.get_values_for_type(x509.DNSName) == ["localhost", "broker-a"]
    usages = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert list(client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.CLIENT_AUTH
    ]


def test_certs_replaces_files_only_with_force(tmp_path: Path) -> None:
    assert _sokutatsu("certs", "--out", str(tmp_path)).returncode == 0
    before = (tmp_path / "ca.pem").read_bytes()
    again = _sokutatsu("certs", "--out", str(tmp_path))
    assert again.returncode == 1
    assert "already holds ca.pem" in again.stderr
    assert (tmp_path / "ca.pem").read_bytes() == before
    (tmp_path / "ca-key.pem").chmod(0o644)
    assert _sokutatsu("certs", "--out", str(tmp_path), "--force").returncode == 0
    assert (tmp_path / "ca.pem").read_bytes() != before
    assert (tmp_path / "ca-key.pem").stat().st_mode & 0o777 == 0o600


def test_a_client_command_with_unusable_tls_settings_says_so_in_one_line(tmp_path: Path) -> None:
    result = _sokutatsu("status", "--monitor", "127.0.0.1:1", env={"SOKUTATSU_TLS_CA": str(tmp_path / "absent.pem")})
    assert result.returncode == 2, result
    assert result.stderr.splitlines() == [
        f"sokutatsu: error: SOKUTATSU_TLS_CA='{tmp_path}/absent.pem': cannot read it: No such file or directory"
    ]
