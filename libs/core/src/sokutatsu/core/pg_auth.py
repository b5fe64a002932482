"""Password authentication of the embedded PostgreSQL cluster (docs/security.md, "PostgreSQL access").

The cluster accepts SCRAM-SHA-256 password logins only: :data:`PG_HBA` is its whole
``pg_hba.conf``, with no ``trust`` line. The passwords of its login roles are generated here
(:mod:`secrets`) and kept in one libpq password file, ``<data folder>/sokutatsu.pgpass``
(mode 0600, the format of ``~/.pgpass``). Clients name that file with the ``passfile``
connection parameter (or ``PGPASSFILE``), so no password appears in a DSN, in a process's
arguments or environment, or in a log line. The server is only ever given SCRAM verifiers
(:func:`scram_verifier`), never a password.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import os
import secrets
from pathlib import Path

PASSFILE_NAME = "sokutatsu.pgpass"
# The server listens on 127.0.0.1 only; "localhost" is for a person typing psql -h localhost.
PASSFILE_HOSTS = ("127.0.0.1", "localhost")
PASSFILE_MODE = 0o600
SCRAM_ITERATIONS = 4096  # PostgreSQL's default (scram_iterations)

PG_HBA = """\
# Written by sokutatsu (docs/security.md, "PostgreSQL access"): every connection logs in with a
# password (SCRAM-SHA-256). The passwords are in sokutatsu.pgpass beside this file.
# TYPE  DATABASE     USER  ADDRESS        METHOD
local   all          all                  scram-sha-256
host    all          all   127.0.0.1/32   scram-sha-256
host    all          all   ::1/128        scram-sha-256
local   replication  all                  scram-sha-256
host    replication  all   127.0.0.1/32   scram-sha-256
host    replication  all   ::1/128        scram-sha-256
"""


def generate_password() -> str:
    """A new random password: 256 bits, URL-safe characters (nothing a passfile must escape)."""
    return secrets.token_urlsafe(32)


def scram_verifier(password: str, salt: bytes | None = None, iterations: int = SCRAM_ITERATIONS) -> str:
    """The SCRAM-SHA-256 verifier PostgreSQL stores for ``password`` (RFC 5802/7677).

    ``ALTER ROLE ... PASSWORD '<verifier>'`` stores it as is, so the server never sees the
    password. (PostgreSQL applies SASLprep first; it changes nothing in an ASCII password
    such as :func:`generate_password`'s.)"""
    salt = salt if salt is not None else secrets.token_bytes(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    stored_key = hashlib.sha256(client_key).digest()
    server_key = hmac.new(salted, b"Server Key", hashlib.sha256).digest()

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode()

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


def _escape(field: str) -> str:
    return field.replace("\\", "\\\\").replace(":", "\\:")


def _fields(line: str) -> list[str]:
    """A passfile line's fields (``\\`` escapes ``:`` and ``\\``)."""
    fields, current, escaped = [], [], False
    for char in line:
        if escaped:
            current.append(char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == ":":
            fields.append("".join(current))
            current = []
        else:
            current.append(char)
    fields.append("".join(current))
    return fields


def read_passfile(path: Path) -> dict[str, str]:
    """user -> password of the loopback lines of a libpq password file; {} when there is none."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    found: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        fields = _fields(line)
        if len(fields) == 5 and fields[0] in (*PASSFILE_HOSTS, "*"):
            found.setdefault(fields[3], fields[4])
    return found


def write_passfile(path: Path, passwords: dict[str, str]) -> None:
    """Replace ``path`` atomically by a password file (mode 0600) with ``passwords`` (user -> password)."""
    lines = ["# Written by sokutatsu: passwords of the embedded PostgreSQL's login roles (keep it 0600)."]
    for user, password in passwords.items():
        lines += [f"{host}:*:*:{_escape(user)}:{_escape(password)}" for host in PASSFILE_HOSTS]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PASSFILE_MODE)
    try:
        with os.fdopen(fd, "w") as out:
            out.write("\n".join(lines) + "\n")
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    tmp.replace(path)


def set_password(path: Path, user: str, password: str) -> None:
    """Add or replace ``user``'s line in the password file at ``path``."""
    passwords = read_passfile(path)
    passwords[user] = password
    write_passfile(path, passwords)
