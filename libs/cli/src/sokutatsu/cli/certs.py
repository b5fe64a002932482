"""``sokutatsu certs``: a development CA with a server and a client certificate (docs/security.md).

For a laptop, a test or a private demo network, not for production: the CA's key sits next to
the certificates it signed. Keys are ECDSA P-256; the server certificate names every host
given (IP addresses as IP SANs, the rest as DNS names) and may also be presented as a client
certificate, since services dial each other with the same files (``SOKUTATSU_TLS_CERT``).

The functions below are what the command runs; the tests use them too, with other dates and
names (an expired certificate, a certificate for another host, an unrelated CA).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS = "127.0.0.1,localhost"
# Certificates start a little in the past, so a clock slightly behind still accepts them.
BACKDATE = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class Issued:
    """A certificate and its private key."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @classmethod
    def load(cls, cert: Path, key: Path) -> Issued:
        """A certificate and key written by :func:`write_set` (e.g. to sign more with its CA)."""
        private = serialization.load_pem_private_key(key.read_bytes(), password=None)
        if not isinstance(private, ec.EllipticCurvePrivateKey):
            raise TypeError(f"{key}: expected an EC private key, as sokutatsu certs writes")
        return cls(x509.load_pem_x509_certificate(cert.read_bytes()), private)

    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def key_pem(self) -> bytes:
        return self.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Sokutatsu"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _validity(
    days: int, not_before: datetime.datetime | None, not_after: datetime.datetime | None
) -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.UTC)
    start = not_before if not_before is not None else now - BACKDATE
    end = not_after if not_after is not None else now + datetime.timedelta(days=days)
    return start, end


def make_ca(
    common_name: str = "Sokutatsu development CA",
    *,
    days: int = 365,
    not_before: datetime.datetime | None = None,
    not_after: datetime.datetime | None = None,
) -> Issued:
    """A self-signed CA that may sign certificates (not other CAs)."""
    key = ec.generate_private_key(ec.SECP256R1())
    start, end = _validity(days, not_before, not_after)
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issued(cert, key)


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return x509.DNSName(host)


def issue(
    ca: Issued,
    common_name: str,
    *,
    hosts: Sequence[str] = (),
    server: bool = True,
    client: bool = True,
    days: int = 365,
    not_before: datetime.datetime | None = None,
    not_after: datetime.datetime | None = None,
) -> Issued:
    """A leaf certificate signed by ``ca``: for a server (naming ``hosts``), a client, or both."""
    key = ec.generate_private_key(ec.SECP256R1())
    start, end = _validity(days, not_before, not_after)
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + (
        [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()),
            critical=False,
        )
    )
    if hosts:
        builder = builder.add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
    return Issued(builder.sign(ca.key, hashes.SHA256()), key)


def write(path: Path, data: bytes, *, secret: bool = False) -> None:
    """Write ``data``; a ``secret`` file (a key) is mode 0600 from its creation on."""
    mode = 0o600 if secret else 0o644
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as out:
        os.fchmod(out.fileno(), mode)  # also when the file was there before with another mode
        out.write(data)


# The files `sokutatsu certs` writes, in its output folder.
FILES = ("ca.pem", "ca-key.pem", "server.pem", "server-key.pem", "client.pem", "client-key.pem")


def write_set(out: Path, hosts: Sequence[str], days: int) -> list[Path]:
    """A CA, a server certificate for ``hosts`` and a client certificate, as :data:`FILES` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    ca = make_ca(days=days)
    served = issue(ca, hosts[0] if hosts else "sokutatsu-server", hosts=hosts, server=True, client=True, days=days)
    client = issue(ca, "sokutatsu-client", server=False, client=True, days=days)
    written = []
    for (cert_name, key_name), issued in zip(
        ((FILES[0], FILES[1]), (FILES[2], FILES[3]), (FILES[4], FILES[5])), (ca, served, client), strict=True
    ):
        write(out / cert_name, issued.cert_pem())
        write(out / key_name, issued.key_pem(), secret=True)
        written += [out / cert_name, out / key_name]
    return written


def certs(
    out: Annotated[Path, typer.Option("--out", help="Folder to write the PEM files to (made if missing).")],
    hosts: Annotated[
        str,
        typer.Option(help="Comma-separated names and addresses the server certificate is valid for."),
    ] = DEFAULT_HOSTS,
    days: Annotated[int, typer.Option(min=1, help="Days the CA and certificates are valid.")] = 365,
    force: Annotated[bool, typer.Option("--force", help="Replace files already in the folder.")] = False,
) -> None:
    """Make a development CA, a server certificate (for --hosts) and a client certificate, for TLS and mTLS.

    Writes ca.pem, ca-key.pem, server.pem, server-key.pem, client.pem and client-key.pem (keys mode 0600);
    then e.g. SOKUTATSU_TLS_CERT=server.pem SOKUTATSU_TLS_KEY=server-key.pem SOKUTATSU_TLS_CA=ca.pem
    (docs/security.md). For development only: the CA's key is in the same folder.
    """
    names = [h.strip() for h in hosts.split(",") if h.strip()]
    if not names:
        raise typer.BadParameter("give at least one host name or address", param_hint="--hosts")
    existing = [name for name in FILES if (out / name).exists()]
    if existing and not force:
        typer.echo(f"sokutatsu: error: {out} already holds {', '.join(existing)} (--force replaces them)", err=True)
        raise typer.Exit(1)
    for path in write_set(out, names, days):
        typer.echo(str(path))
    typer.echo(f"server certificate for: {', '.join(names)}; valid {days} days")
