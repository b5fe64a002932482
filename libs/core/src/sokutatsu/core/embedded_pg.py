"""A private PostgreSQL cluster for the launcher and the test session.

:class:`EmbeddedPostgres` runs the system's ``initdb`` and ``pg_ctl`` on a data
folder of its own, on a free loopback port, and stops it cleanly. PostgreSQL
refuses to run as root, so when this process is root the cluster runs as the
``postgres`` user, and the data folder must be reachable by that user.

:func:`provide_postgres` is what callers use: it yields the DSN of
``SOKUTATSU_PG_DSN`` when that is set (nothing is started), and otherwise
starts an embedded cluster for the duration of the ``with`` block.

Every failure (no binaries, a folder owned by someone else, a server that does
not start) raises :class:`PostgresError` with one line saying what to do.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import logging
import os
import pwd
import re
import shutil
import socket
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import psycopg
from psycopg import sql

from sokutatsu.core.errors import StartupError
from sokutatsu.core.settings import Settings, parse_int, parse_optional_path, setting

log = logging.getLogger(__name__)

SUPERUSER = "sokutatsu"
SERVER_CONF = """
# Added by sokutatsu (embedded cluster)
listen_addresses = '127.0.0.1'
unix_socket_directories = ''
max_prepared_transactions = 64
max_connections = 200
logging_collector = off
"""


class PostgresError(StartupError):
    """The embedded cluster cannot be found, prepared, started or stopped."""


@dataclass(frozen=True)
class PostgresSettings(Settings):
    env_prefix: ClassVar[str] = "SOKUTATSU_PG_"

    dsn: str = setting("DSN", "", "Use this PostgreSQL instead of starting an embedded cluster (tests and launcher).")
    bindir: Path | None = setting(
        "BINDIR",
        None,
        "Folder holding initdb and pg_ctl; unset = PATH, then /usr/lib/postgresql/*/bin.",
        parse_optional_path,
    )
    data: Path | None = setting(
        "DATA", None, "Data folder of the embedded cluster; unset = <state dir>/postgres.", parse_optional_path
    )
    port: int = setting("PORT", 0, "Port of the embedded cluster; 0 = a free port at each start.", parse_int)


def _version_key(path: Path) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", str(path))) or (0,)


def find_bindir(configured: Path | None = None) -> Path:
    """The folder with ``initdb`` and ``pg_ctl``, newest version first."""

    def ok(d: Path) -> bool:
        return (d / "initdb").is_file() and (d / "pg_ctl").is_file()

    if configured is not None:
        if ok(configured):
            return configured
        raise PostgresError(f"SOKUTATSU_PG_BINDIR={configured} holds no initdb and pg_ctl")
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(found).resolve().parent
    candidates = [Path(p) for p in ("/usr/local/pgsql/bin",)]
    for pattern in ("/usr/lib/postgresql/*/bin", "/usr/pgsql-*/bin", "/opt/homebrew/opt/postgresql*/bin"):
        candidates += sorted((Path(p) for p in glob.glob(pattern)), key=_version_key, reverse=True)
    for candidate in candidates:
        if ok(candidate):
            return candidate
    raise PostgresError(
        "PostgreSQL server binaries (initdb, pg_ctl) not found on PATH or in /usr/lib/postgresql/*/bin: "
        "run `make setup` (installs Debian's postgresql package), install PostgreSQL 14 or newer yourself, "
        "or set SOKUTATSU_PG_BINDIR"
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass(frozen=True)
class _RunAs:
    name: str
    uid: int
    gid: int


def _run_as() -> _RunAs | None:
    """The user to run PostgreSQL as when we are root; None = ourselves."""
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam("postgres")
    except KeyError:
        raise PostgresError(
            "running as root, and PostgreSQL refuses root: create a 'postgres' user "
            "(useradd --system postgres) or run as an ordinary user"
        ) from None
    return _RunAs(name="postgres", uid=entry.pw_uid, gid=entry.pw_gid)


def _can_reach(path: Path, who: _RunAs) -> bool:
    """Whether ``who`` may traverse every existing ancestor of ``path``."""
    for parent in [path, *path.parents]:
        if not parent.exists():
            continue
        st = parent.stat()
        if st.st_uid == who.uid:
            bit = stat.S_IXUSR
        elif st.st_gid == who.gid:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            return False
    return True


def default_data_dir(state_dir: Path) -> Path:
    """``<state_dir>/postgres``, or a folder under the temp dir when the ``postgres`` user cannot reach it."""
    preferred = state_dir.resolve() / "postgres"
    who = _run_as()
    if who is None or _can_reach(preferred.parent, who):
        return preferred
    digest = hashlib.sha256(str(preferred).encode()).hexdigest()[:10]
    fallback = Path(tempfile.gettempdir()) / f"sokutatsu-{digest}" / "postgres"
    log.info("%s is not reachable by the postgres user; the cluster lives in %s", preferred, fallback)
    return fallback


class EmbeddedPostgres:
    """One private cluster on ``data_dir``. Use as a context manager or call start/stop."""

    def __init__(self, data_dir: Path, bindir: Path | None = None, port: int = 0) -> None:
        self.data_dir = data_dir.resolve()
        self.bindir = find_bindir(bindir)
        self._fixed_port = port
        self.port = 0
        self._who = _run_as()
        self._started_here = False

    # -- helpers ---------------------------------------------------------------
    @property
    def log_file(self) -> Path:
        return self.data_dir / "server.log"

    @property
    def dsn(self) -> str:
        return self.dsn_for("postgres")

    def dsn_for(self, database: str) -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        kwargs: dict[str, object] = {}
        if self._who is not None:
            kwargs = {"user": self._who.uid, "group": self._who.gid, "extra_groups": []}
        proc: subprocess.CompletedProcess[str] = subprocess.run(  # noqa: S603 - fixed binaries, built here
            [str(self.bindir / args[0]), *args[1:]],
            capture_output=True,
            text=True,
            cwd="/",
            env={**os.environ, "LC_ALL": "C", "LANG": "C"},
            check=False,
            **kwargs,  # type: ignore[call-overload]
        )
        if check and proc.returncode != 0:
            detail = (proc.stderr or proc.stdout).strip().splitlines()
            raise PostgresError(f"{args[0]} failed on {self.data_dir}: {detail[-1] if detail else proc.returncode}")
        return proc

    def _owner_name(self, uid: int) -> str:
        try:
            return pwd.getpwuid(uid).pw_name
        except KeyError:
            return f"uid {uid}"

    def _prepare_folder(self) -> bool:
        """Check or create the data folder; return True when it needs initdb."""
        who_uid = self._who.uid if self._who else os.geteuid()
        who_name = self._who.name if self._who else self._owner_name(os.geteuid())
        d = self.data_dir
        if self._who is not None and not _can_reach(d.parent, self._who):
            raise PostgresError(
                f"the postgres user cannot reach {d.parent} (PostgreSQL runs as postgres because this is root); "
                "set SOKUTATSU_PG_DATA to a folder under /tmp or /var/tmp"
            )
        if d.exists() and any(d.iterdir()):
            owner = d.stat().st_uid
            if owner != who_uid:
                raise PostgresError(
                    f"data folder {d} belongs to {self._owner_name(owner)}, but the cluster runs as {who_name}: "
                    "choose another folder (SOKUTATSU_PG_DATA or the state dir) or hand this one over"
                )
            if not (d / "PG_VERSION").exists():
                raise PostgresError(f"{d} is not empty and is not a PostgreSQL data folder; choose an empty folder")
            return False
        d.mkdir(parents=True, exist_ok=True)
        if self._who is not None:
            os.chown(d, self._who.uid, self._who.gid)
        d.chmod(0o700)
        return True

    def _running_port(self) -> int | None:
        """The port of a server already running on this folder, if any."""
        pid_file = self.data_dir / "postmaster.pid"
        if not pid_file.exists():
            return None
        if self._run("pg_ctl", "status", "-D", str(self.data_dir), check=False).returncode != 0:
            return None
        lines = pid_file.read_text().splitlines()
        return int(lines[3]) if len(lines) > 3 and lines[3].isdigit() else None

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> str:
        """Initialise the folder if new, start the server, return its DSN."""
        if self._prepare_folder():
            self._run(
                "initdb",
                "-D",
                str(self.data_dir),
                "-U",
                SUPERUSER,
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C",
                "--no-instructions",
            )
            with (self.data_dir / "postgresql.conf").open("a") as conf:
                conf.write(SERVER_CONF)
            log.info("initialised PostgreSQL cluster in %s", self.data_dir)
        running = self._running_port()
        if running is not None:
            self.port = running
            log.info("reusing the PostgreSQL server already running on %s (port %d)", self.data_dir, running)
            self._started_here = True
            return self.dsn
        attempts = 1 if self._fixed_port else 5
        for _ in range(attempts):
            self.port = self._fixed_port or free_port()
            proc = self._run(
                "pg_ctl",
                "start",
                "-w",
                "-t",
                "60",
                "-D",
                str(self.data_dir),
                "-l",
                str(self.log_file),
                "-o",
                f"-p {self.port}",
                check=False,
            )
            if proc.returncode == 0:
                self._started_here = True
                log.info("PostgreSQL running on 127.0.0.1:%d (%s)", self.port, self.data_dir)
                return self.dsn
            if "already in use" not in self._log_tail():
                break
        raise PostgresError(f"PostgreSQL did not start on {self.data_dir}: {self._last_error()} (log: {self.log_file})")

    def _log_tail(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def _last_error(self) -> str:
        lines = [ln for ln in self._log_tail().splitlines() if "FATAL" in ln or "ERROR" in ln]
        return lines[-1].split(":  ", 1)[-1] if lines else "see the log"

    def stop(self) -> None:
        """Stop the server (fast shutdown: in-flight transactions roll back, data is flushed)."""
        if not self._started_here:
            return
        proc = self._run("pg_ctl", "stop", "-w", "-t", "60", "-m", "fast", "-D", str(self.data_dir), check=False)
        if proc.returncode != 0 and self._running_port() is not None:
            self._run("pg_ctl", "stop", "-w", "-m", "immediate", "-D", str(self.data_dir), check=False)
        self._started_here = False
        log.info("PostgreSQL on %s stopped", self.data_dir)

    def __enter__(self) -> EmbeddedPostgres:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def create_database(dsn: str, name: str) -> None:
    """Create database ``name`` on the server at ``dsn`` unless it exists."""
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        if not exists:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def database_dsn(dsn: str, name: str) -> str:
    """``dsn`` pointing at database ``name`` instead."""
    return psycopg.conninfo.make_conninfo(dsn, dbname=name)


@contextlib.contextmanager
def provide_postgres(state_dir: Path, settings: PostgresSettings | None = None) -> Iterator[str]:
    """Yield a superuser DSN: ``SOKUTATSU_PG_DSN`` if set, else an embedded cluster's."""
    settings = settings or PostgresSettings()
    if settings.dsn:
        yield settings.dsn
        return
    data = settings.data or default_data_dir(state_dir)
    with EmbeddedPostgres(data, settings.bindir, settings.port) as pg:
        yield pg.dsn
