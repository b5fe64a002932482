"""A private PostgreSQL cluster for the launcher and the test session.

:class:`EmbeddedPostgres` runs the system's ``initdb`` and ``pg_ctl`` on a data
folder of its own, on a free loopback port, and stops it cleanly. PostgreSQL
refuses to run as root, so when this process is root the cluster runs as the
``postgres`` user, and the data folder must be reachable by that user.

:func:`provide_postgres` is what callers use: it yields the DSN of
``SOKUTATSU_PG_DSN`` when that is set (nothing is started), and otherwise
starts an embedded cluster for the duration of the ``with`` block.

Safety rules:

* A new cluster is made by ``initdb`` in a hidden sibling folder, configured,
  and only then renamed into place, so an interrupted ``initdb`` never leaves a
  half-made data folder behind (leftover siblings are removed at the next start).
* While an :class:`EmbeddedPostgres` has the data folder, it holds an exclusive
  ``flock`` on it: a second one (another launcher, another test session) is
  refused instead of sharing, and later stopping, the first one's server.
* A server found running on the folder when nobody holds that lock is a
  leftover of a run that crashed: it is adopted (reused, and stopped at the
  end like one started here). A server is never stopped otherwise unless this
  object started it.
* If anything fails or is interrupted once ``pg_ctl start`` has been tried,
  the server is stopped again before the error propagates (``__exit__`` does
  not run when ``__enter__`` fails).

* Only password logins (SCRAM-SHA-256) are accepted, for every role and
  address (``pg_hba.conf`` has no ``trust`` line, see :mod:`sokutatsu.core.pg_auth`). The
  superuser's password is generated at ``initdb`` and kept in the data folder's password
  file (``sokutatsu.pgpass``, mode 0600), which :attr:`EmbeddedPostgres.dsn` names
  (``passfile=``): the DSN itself carries no password. A folder without that file (made by an
  older sokutatsu with ``trust``, or whose file was deleted) gets a new password, set with
  the server stopped (single-user mode), and the password-only ``pg_hba.conf``.

Every failure (no binaries, a folder owned by someone else, a server that does
not start, an unreachable server) raises :class:`PostgresError` with one line
saying what to do; DSNs in messages never show a password.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import logging
import os
import pwd
import random
import re
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from psycopg.conninfo import make_conninfo

from sokutatsu.core.dsn import PostgresError
from sokutatsu.core.pg_auth import (
    PASSFILE_MODE,
    PASSFILE_NAME,
    PG_HBA,
    generate_password,
    read_passfile,
    scram_verifier,
    set_password,
)
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
# pg_ctl waits this long for the server to start or stop.
PG_CTL_TIMEOUT_SECONDS = 60


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
    for pattern in (
        "/usr/lib/postgresql/*/bin",
        "/usr/pgsql-*/bin",
        "/opt/homebrew/opt/postgresql*/bin",
        "/usr/local/opt/postgresql*/bin",
    ):
        candidates += sorted((Path(p) for p in glob.glob(pattern)), key=_version_key, reverse=True)
    for candidate in candidates:
        if ok(candidate):
            return candidate
    raise PostgresError(
        "PostgreSQL server binaries (initdb, pg_ctl) not found on PATH or in /usr/lib/postgresql/*/bin: "
        "run `make setup` (installs Debian's postgresql package), install PostgreSQL 14 or newer yourself, "
        "or set SOKUTATSU_PG_BINDIR"
    )


# Where free_port() looks: this many ports below the kernel's ephemeral range.
_PORT_SPAN = 10_000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A loopback TCP port nothing uses now, for a process that binds it later.

    Below the kernel's ephemeral range: a port the kernel picks for a bind to port 0 comes from
    that range, which outgoing connections draw their source ports from too, so between this
    call and the bind another connection on the machine could take it ("the port is already in
    use", seen once in CI under load). Below the range only listeners take ports.
    """
    low = _ephemeral_low()
    first, last = max(1024, low - _PORT_SPAN), low - 1
    if first < last:
        pick = random.SystemRandom()
        for _ in range(200):
            port = pick.randint(first, last)
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        kernel_pick: int = s.getsockname()[1]
        return kernel_pick


@dataclass(frozen=True)
class _RunAs:
    name: str
    uid: int
    gid: int


# util-linux's setpriv (in every Debian install): runs a program as another user.
_SETPRIV = shutil.which("setpriv") or "/usr/bin/setpriv"


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


@contextlib.contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``folder`` (waiting for it) for the ``with`` block."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@dataclass(frozen=True)
class _Result:
    returncode: int
    stdout: str
    stderr: str


class EmbeddedPostgres:
    """One private cluster on ``data_dir``. Use as a context manager or call start/stop."""

    def __init__(self, data_dir: Path, bindir: Path | None = None, port: int = 0) -> None:
        self.data_dir = data_dir.resolve()
        self.bindir = find_bindir(bindir)
        self._fixed_port = port
        self.port = 0
        self._who = _run_as()
        # Whether stop() stops the server: it was started here, or adopted from a crashed run.
        self._owns_server = False
        self._lock_fd: int | None = None

    # -- helpers ---------------------------------------------------------------
    @property
    def _as_postgres(self) -> list[str]:
        """The prefix that runs a program as the postgres user when we are root.

        setpriv changes user in the child after exec, rather than Popen(user=...) between fork
        and exec: with a user change Python must fork() (not vfork()), and a fork() while gRPC's
        threads are busy runs gRPC's fork handlers in the child, which can crash it before exec."""
        who = self._who
        if who is None:
            return []
        return [_SETPRIV, f"--reuid={who.uid}", f"--regid={who.gid}", "--clear-groups", "--"]

    @property
    def log_file(self) -> Path:
        return self.data_dir / "server.log"

    @property
    def passfile(self) -> Path:
        """The password file of this cluster's login roles (mode 0600)."""
        return self.data_dir / PASSFILE_NAME

    @property
    def dsn(self) -> str:
        return self.dsn_for("postgres")

    def dsn_for(self, database: str) -> str:
        """The superuser's DSN for ``database``; its password is read from :attr:`passfile`."""
        return cluster_dsn(self.port, self.passfile, database)

    def _run(self, *args: str, check: bool = True, finish: bool = True, stdin_text: str | None = None) -> _Result:
        """Run a PostgreSQL program (as postgres when root) in its own session.

        Its own session keeps a terminal's Ctrl-C away from it: only this
        process decides. If this process is interrupted meanwhile, the program
        is left to finish (``finish``, e.g. ``pg_ctl start``, so that the
        server's state is known afterwards) or killed (``initdb``), and the
        interruption propagates.
        """
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as given:
            given.write((stdin_text or "").encode())
            given.seek(0)
            proc = subprocess.Popen(  # noqa: S603 - fixed binaries, built here
                [*self._as_postgres, str(self.bindir / args[0]), *args[1:]],
                stdin=given if stdin_text is not None else subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd="/",
                env={**os.environ, "LC_ALL": "C", "LANG": "C"},
                start_new_session=True,
            )
            try:
                code = proc.wait()
            except BaseException:
                if not finish:
                    proc.kill()
                proc.wait()
                raise
            out.seek(0)
            err.seek(0)
            result = _Result(code, out.read().decode(errors="replace"), err.read().decode(errors="replace"))
        if check and result.returncode != 0:
            detail = (result.stderr or result.stdout).strip().splitlines()
            raise PostgresError(f"{args[0]} failed on {self.data_dir}: {detail[-1] if detail else result.returncode}")
        return result

    def _owner_name(self, uid: int) -> str:
        try:
            return pwd.getpwuid(uid).pw_name
        except KeyError:
            return f"uid {uid}"

    def _check_existing(self) -> None:
        """The data folder is not empty: it must be a cluster the server's user owns."""
        d = self.data_dir
        who_uid = self._who.uid if self._who else os.geteuid()
        who_name = self._who.name if self._who else self._owner_name(os.geteuid())
        owner = d.stat().st_uid
        if owner != who_uid:
            raise PostgresError(
                f"data folder {d} belongs to {self._owner_name(owner)}, but the cluster runs as {who_name}: "
                "choose another folder (SOKUTATSU_PG_DATA or the state dir) or hand this one over"
            )
        if not (d / "PG_VERSION").exists():
            raise PostgresError(f"{d} is not empty and is not a PostgreSQL data folder; choose an empty folder")

    def _prepare_folder(self) -> None:
        """Check the data folder, or make a new cluster there."""
        d = self.data_dir
        if self._who is not None and not _can_reach(d.parent, self._who):
            raise PostgresError(
                f"the postgres user cannot reach {d.parent} (PostgreSQL runs as postgres because this is root); "
                "set SOKUTATSU_PG_DATA to a folder under /tmp or /var/tmp"
            )
        if d.is_dir() and any(d.iterdir()):
            self._check_existing()
            return
        d.parent.mkdir(parents=True, exist_ok=True)
        # One initdb at a time next to this folder, so leftovers can be removed safely.
        with _folder_lock(d.parent):
            if d.is_dir() and any(d.iterdir()):
                self._check_existing()
                return
            self._initdb_into_place()

    def _initdb_into_place(self) -> None:
        """initdb in a hidden sibling folder, configure it, then rename it to the data folder.

        The hidden folder holds the superuser's SCRAM verifier for ``initdb --pwfile`` (the
        password itself never leaves this process) and the new cluster in ``data/``."""
        d = self.data_dir
        for leftover in d.parent.glob(f".{d.name}.initdb-*"):
            log.info("removing %s, left by an interrupted initdb", leftover)
            _remove_tree(leftover)
        tmp = Path(tempfile.mkdtemp(prefix=f".{d.name}.initdb-", dir=d.parent))
        try:
            if self._who is not None:
                os.chown(tmp, self._who.uid, self._who.gid)
            tmp.chmod(0o700)
            password = generate_password()
            pwfile = tmp / "superuser.scram"
            pwfile.write_text(scram_verifier(password) + "\n")
            if self._who is not None:
                os.chown(pwfile, self._who.uid, self._who.gid)
            new = tmp / "data"
            self._run(
                "initdb",
                "-D",
                str(new),
                "-U",
                SUPERUSER,
                f"--pwfile={pwfile}",
                "--auth-host=scram-sha-256",
                "--auth-local=scram-sha-256",
                "--encoding=UTF8",
                "--locale=C",
                "--no-instructions",
                finish=False,
            )
            with (new / "postgresql.conf").open("a") as conf:
                conf.write(SERVER_CONF)
            (new / "pg_hba.conf").write_text(PG_HBA)
            set_password(new / PASSFILE_NAME, SUPERUSER, password)
            try:
                # Replaces the data folder if it exists and is empty.
                new.rename(d)
            except OSError as exc:
                raise PostgresError(
                    f"cannot move the new cluster into {d}: {exc.strerror or exc}; "
                    "choose a folder that does not exist yet (SOKUTATSU_PG_DATA)"
                ) from None
        except BaseException:
            _remove_tree(tmp)
            raise
        _remove_tree(tmp)
        log.info("initialised PostgreSQL cluster in %s (password logins only)", d)

    def _has_password(self) -> bool:
        """Whether the superuser's password is in the passfile (and the file is private again)."""
        if SUPERUSER not in read_passfile(self.passfile):
            return False
        self.passfile.chmod(PASSFILE_MODE)
        return True

    def _secure_existing(self) -> None:
        """Give a cluster without a passfile a new superuser password and the password-only pg_hba.conf.

        The server must be stopped: the password is set in single-user mode, which needs no
        login. Set first, the passfile written last, so an interruption is repaired by the next
        start doing it again."""
        password = generate_password()
        statement = f"ALTER ROLE {SUPERUSER} PASSWORD '{scram_verifier(password)}';\n"
        result = self._run(
            "postgres", "--single", "-D", str(self.data_dir), "postgres", stdin_text=statement, check=False
        )
        said = f"{result.stdout}\n{result.stderr}"
        if result.returncode != 0 or "ERROR" in said or "FATAL" in said:
            raise PostgresError(
                f"cannot set a password on the cluster in {self.data_dir}: {_last_error(said, result)}; "
                "move that folder away to start a new cluster there"
            )
        hba = self.data_dir / "pg_hba.conf"
        with hba.open("w") as out:  # in place: it keeps its owner (postgres when this is root)
            out.write(PG_HBA)
        set_password(self.passfile, SUPERUSER, password)
        log.info(
            "the cluster in %s had no password file (made with trust by an older sokutatsu, or the file "
            "was deleted): it now takes password logins only; the new password is in %s",
            self.data_dir,
            self.passfile,
        )

    def _lock(self) -> None:
        """Take the data folder for this object, or refuse if another process has it."""
        fd = os.open(self.data_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise PostgresError(
                f"data folder {self.data_dir} is in use by another sokutatsu process (a launcher or a test "
                "session): stop that one, or choose another folder (SOKUTATSU_STATE_DIR or SOKUTATSU_PG_DATA)"
            ) from None
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _server_running(self) -> bool:
        """Whether a postmaster is running on this folder."""
        if not (self.data_dir / "postmaster.pid").exists():
            return False
        return self._run("pg_ctl", "status", "-D", str(self.data_dir), check=False).returncode == 0

    def _running_port(self) -> int | None:
        """The port of a server already running on this folder, if any."""
        if not self._server_running():
            return None
        try:
            lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
        except OSError:
            return None
        return int(lines[3]) if len(lines) > 3 and lines[3].isdigit() else None

    def _log_size(self) -> int:
        try:
            return self.log_file.stat().st_size
        except OSError:
            return 0

    def _log_since(self, offset: int) -> str:
        """What the server logged after ``offset`` (the log is appended to by every start)."""
        try:
            with self.log_file.open("rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> str:
        """Initialise the folder if new, start (or adopt) the server, return its DSN."""
        self._prepare_folder()
        self._lock()
        try:
            running = self._running_port()
            if not self._has_password():
                if running is not None:  # left by a crashed run; single-user mode needs it stopped
                    self._shutdown_if_running()
                    running = None
                self._secure_existing()
            if running is not None:
                # We hold the folder's lock, so no live sokutatsu process manages this server.
                self.port = running
                self._owns_server = True
                log.info(
                    "adopting the PostgreSQL server a crashed run left on %s (port %d); it is stopped at the end",
                    self.data_dir,
                    running,
                )
                return self.dsn
            self._start_server()
        except BaseException:
            self._unlock()
            raise
        return self.dsn

    def _start_server(self) -> None:
        try:
            self._start_attempts()
        except BaseException:
            # Failed, timed out or interrupted: a server that did come up must not outlive us.
            if self._shutdown_if_running():
                log.info("stopped the PostgreSQL server on %s again (its start did not complete)", self.data_dir)
            raise

    def _start_attempts(self) -> None:
        """pg_ctl start; with a free port, try again when another process took it meanwhile."""
        attempts = 1 if self._fixed_port else 5
        for _ in range(attempts):
            self.port = self._fixed_port or free_port()
            offset = self._log_size()
            proc = self._run(
                "pg_ctl",
                "start",
                "-w",
                "-t",
                str(PG_CTL_TIMEOUT_SECONDS),
                "-D",
                str(self.data_dir),
                "-l",
                str(self.log_file),
                "-o",
                f"-p {self.port}",
                check=False,
            )
            if proc.returncode == 0:
                self._owns_server = True
                log.info("PostgreSQL running on 127.0.0.1:%d (%s)", self.port, self.data_dir)
                return
            logged = self._log_since(offset)
            if "already in use" not in logged:
                break
            if self._fixed_port:
                raise PostgresError(
                    f"PostgreSQL cannot listen on 127.0.0.1:{self.port}: the port is already in use "
                    "(set SOKUTATSU_PG_PORT to another port, or 0 for a free one)"
                )
        raise PostgresError(
            f"PostgreSQL did not start on {self.data_dir}: {_last_error(logged, proc)} (log: {self.log_file})"
        )

    def _shutdown_if_running(self) -> bool:
        """Stop a server running on the folder (fast, then immediate); whether there was one."""
        if not self._server_running():
            return False
        timeout = str(PG_CTL_TIMEOUT_SECONDS)
        proc = self._run("pg_ctl", "stop", "-w", "-t", timeout, "-m", "fast", "-D", str(self.data_dir), check=False)
        if proc.returncode != 0 and self._server_running():
            self._run("pg_ctl", "stop", "-w", "-t", timeout, "-m", "immediate", "-D", str(self.data_dir), check=False)
        return True

    def stop(self) -> None:
        """Stop the server if this object started or adopted it (fast shutdown), and release the folder."""
        try:
            if self._owns_server:
                self._owns_server = False
                self._shutdown_if_running()
                log.info("PostgreSQL on %s stopped", self.data_dir)
        finally:
            self._unlock()

    def __enter__(self) -> EmbeddedPostgres:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _last_error(logged: str, proc: _Result) -> str:
    lines = [ln for ln in logged.splitlines() if any(k in ln for k in ("FATAL", "ERROR", "PANIC"))]
    if lines:
        return lines[-1].split(":  ", 1)[-1].strip()
    said = (proc.stderr or proc.stdout).strip().splitlines()
    return said[-1] if said else "see the log"


REMOVE_ATTEMPTS = 50


def _remove_tree(path: Path) -> None:
    """Remove ``path`` even while an interrupted initdb's last child is still writing into it."""
    for _ in range(REMOVE_ATTEMPTS):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return
        time.sleep(0.05)
    log.warning("could not remove %s; it is removed at the next start", path)


# ------------------------------------------------------- using a server --


def cluster_dsn(port: int, passfile: Path, database: str = "postgres") -> str:
    """The superuser's DSN of an embedded cluster: no password, the ``passfile`` that holds it."""
    return make_conninfo("", host="127.0.0.1", port=str(port), user=SUPERUSER, dbname=database, passfile=str(passfile))


def running_cluster_dsn(data_dir: Path, database: str = "postgres") -> str:
    """The DSN of the embedded cluster running on ``data_dir`` (started by another process).

    PostgresError (one line) when no server runs there or it has no password file."""
    data_dir = data_dir.resolve()
    passfile = data_dir / PASSFILE_NAME
    try:
        lines = (data_dir / "postmaster.pid").read_text().splitlines()
        pid, port = int(lines[0]), int(lines[3])
        with contextlib.suppress(PermissionError):  # alive, as another user
            os.kill(pid, 0)
    except (OSError, ValueError, IndexError):
        raise PostgresError(
            f"no PostgreSQL is running on {data_dir}: start the suite first (sokutatsu up), "
            "or point SOKUTATSU_STATE_DIR or SOKUTATSU_PG_DATA at the folder of the one that runs"
        ) from None
    if not passfile.is_file():
        raise PostgresError(f"{passfile} does not exist: restart the suite (sokutatsu up) to make it")
    return cluster_dsn(port, passfile, database)


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
