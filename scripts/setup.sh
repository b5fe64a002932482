#!/usr/bin/env bash
# make setup: install what the project needs on a fresh machine, then sync .venv.
#   1. uv (from PyPI into .tools/ when it is not on PATH);
#   2. PostgreSQL server binaries (initdb, pg_ctl) when missing: the system's
#      package manager (apt-get, dnf, yum, apk) as root or through passwordless
#      sudo, or Homebrew; otherwise a message saying what to install;
#   3. the workspace from uv.lock into .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf 'setup: %s\n' "$*"; }
fail() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

# -- uv --------------------------------------------------------------------
if command -v uv >/dev/null 2>&1; then
  UV=$(command -v uv)
elif [ -x .tools/bin/uv ]; then
  UV=.tools/bin/uv
else
  command -v python3 >/dev/null 2>&1 || fail "python3 is needed to install uv; install Python 3.11"
  say "installing uv into .tools/"
  python3 -m venv .tools || fail "python3 -m venv failed; install the venv module (apt-get install python3-venv)"
  .tools/bin/python -m pip install --quiet --disable-pip-version-check uv || fail "could not install uv from PyPI"
  UV=.tools/bin/uv
fi

# -- PostgreSQL binaries -----------------------------------------------------
have_pg() {
  if [ -n "${SOKUTATSU_PG_BINDIR:-}" ]; then [ -x "$SOKUTATSU_PG_BINDIR/initdb" ]; return; fi
  command -v initdb >/dev/null 2>&1 && command -v pg_ctl >/dev/null 2>&1 && return 0
  compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || compgen -G '/usr/pgsql-*/bin/initdb' >/dev/null \
    || compgen -G '/opt/homebrew/opt/postgresql*/bin/initdb' >/dev/null \
    || compgen -G '/usr/local/opt/postgresql*/bin/initdb' >/dev/null
}
# Whether we may run a command as root: we are root, or sudo works without a password.
can_root() {
  [ "$(id -u)" = 0 ] || { command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; }
}
as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; else sudo -n "$@"; fi
}
# Install PostgreSQL with the first package manager we may use; false when none.
install_pg() {
  if command -v apt-get >/dev/null 2>&1 && can_root; then
    say "installing PostgreSQL server binaries (apt-get install postgresql)"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq \
      && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql >/dev/null
  elif command -v dnf >/dev/null 2>&1 && can_root; then
    say "installing PostgreSQL server binaries (dnf install postgresql-server)"
    as_root dnf install -y -q postgresql-server >/dev/null
  elif command -v yum >/dev/null 2>&1 && can_root; then
    say "installing PostgreSQL server binaries (yum install postgresql-server)"
    as_root yum install -y -q postgresql-server >/dev/null
  elif command -v apk >/dev/null 2>&1 && can_root; then
    say "installing PostgreSQL server binaries (apk add postgresql)"
    as_root apk add --no-cache --quiet postgresql >/dev/null
  elif command -v brew >/dev/null 2>&1 && [ "$(id -u)" != 0 ]; then
    say "installing PostgreSQL server binaries (brew install postgresql@16)"
    brew install --quiet postgresql@16 >/dev/null
  else
    return 2
  fi
}
if [ -n "${SOKUTATSU_PG_DSN:-}" ]; then
  : # an external PostgreSQL is given; no binaries needed
elif ! have_pg; then
  missing="PostgreSQL server binaries (initdb, pg_ctl) are missing: install them (Debian/Ubuntu: sudo apt-get install postgresql; Fedora: sudo dnf install postgresql-server; Alpine: apk add postgresql; macOS: brew install postgresql@16), or set SOKUTATSU_PG_BINDIR, or set SOKUTATSU_PG_DSN to use an existing server"
  status=0
  install_pg || status=$?
  if [ "$status" = 2 ]; then
    fail "$missing"
  elif [ "$status" != 0 ] || ! have_pg; then
    fail "installing PostgreSQL failed; $missing"
  fi
fi
if [ "$(id -u)" = 0 ] && [ -z "${SOKUTATSU_PG_DSN:-}" ] && ! id postgres >/dev/null 2>&1; then
  fail "running as root, PostgreSQL must run as the 'postgres' user, which does not exist: useradd --system postgres"
fi

# -- Python environment ------------------------------------------------------
export UV_PYTHON_DOWNLOADS=never
# Trust the system's certificate store (as pip and curl do), e.g. behind a TLS-inspecting proxy.
# uv 0.9 and later call it UV_SYSTEM_CERTS (UV_NATIVE_TLS is deprecated there and warns).
if "$UV" help sync 2>/dev/null | grep -q -- '--system-certs'; then
  export UV_SYSTEM_CERTS=1
  unset UV_NATIVE_TLS
else
  export UV_NATIVE_TLS=1
fi
# --compile-bytecode: the third-party packages are installed with their bytecode. A machine may
# set PYTHONDONTWRITEBYTECODE (this project's CI machines do), and then every Python process
# would compile grpc, protobuf, psycopg... from source again: 0.2 s of CPU at each start of a
# service, and the test suite starts about 700 of them (README.md, "make test").
"$UV" sync --locked --quiet --compile-bytecode || fail "uv sync failed (is Python 3.11 installed? is uv.lock current? run: uv lock)"
