"""Certificates for the TLS tests, made by the code of ``sokutatsu certs``.

The good set is exactly what the command writes (``write_set``); the bad ones are made with
the same functions: an unrelated CA with its own client and server certificates, a server
certificate of the good CA that expired yesterday, and one of the good CA for another host.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

import pytest

from sokutatsu.cli.certs import Issued, issue, make_ca, write, write_set
from sokutatsu.client import ChannelTls
from sokutatsu.core.tls import ServerTls

HOSTS = ["127.0.0.1", "localhost"]


@dataclass(frozen=True)
class Pem:
    cert: Path
    key: Path

    def server(self, client_ca: Path | None = None) -> ServerTls:
        """This certificate served; with ``client_ca``, clients must present one signed by it (mTLS)."""
        return ServerTls(
            private_key=self.key.read_bytes(),
            certificate_chain=self.cert.read_bytes(),
            client_ca=client_ca.read_bytes() if client_ca else None,
            require_client_auth=client_ca is not None,
        )


@dataclass(frozen=True)
class Certs:
    folder: Path
    ca: Path  # the good CA (ca.pem of `sokutatsu certs`)
    server: Pem
    client: Pem
    other_ca: Path  # an unrelated CA
    other_server: Pem
    other_client: Pem
    expired_server: Pem  # signed by the good CA, not valid since yesterday
    wrong_host_server: Pem  # signed by the good CA, for elsewhere.example only

    def client_tls(self, ca: Path | None = None, client: Pem | None = None) -> ChannelTls:
        """A client trusting ``ca`` (default: the good CA), presenting ``client`` if given."""
        return ChannelTls.from_files(ca or self.ca, client.cert if client else None, client.key if client else None)


def _save(folder: Path, name: str, issued: Issued) -> Pem:
    pem = Pem(folder / f"{name}.pem", folder / f"{name}-key.pem")
    write(pem.cert, issued.cert_pem())
    write(pem.key, issued.key_pem(), secret=True)
    return pem


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    folder = tmp_path_factory.mktemp("certs")
    write_set(folder, HOSTS, days=1)
    now = datetime.datetime.now(datetime.UTC)
    ca = Issued.load(folder / "ca.pem", folder / "ca-key.pem")  # the written CA signs the bad ones too
    other = make_ca("Unrelated CA")
    write(folder / "other-ca.pem", other.cert_pem())
    return Certs(
        folder=folder,
        ca=folder / "ca.pem",
        server=Pem(folder / "server.pem", folder / "server-key.pem"),
        client=Pem(folder / "client.pem", folder / "client-key.pem"),
        other_ca=folder / "other-ca.pem",
        other_server=_save(folder, "other-server", issue(other, "127.0.0.1", hosts=HOSTS)),
        other_client=_save(folder, "other-client", issue(other, "intruder", server=False)),
        expired_server=_save(
            folder,
            "expired-server",
            issue(
                ca,
                "127.0.0.1",
                hosts=HOSTS,
                not_before=now - datetime.timedelta(days=10),
                not_after=now - datetime.timedelta(days=1),
            ),
        ),
        wrong_host_server=_save(
            folder, "wrong-host-server", issue(ca, "elsewhere.example", hosts=["elsewhere.example"])
        ),
    )


__all__ = ["Certs", "Pem", "certs"]
