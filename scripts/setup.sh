#!/usr/bin/env bash
# make setup: install what the project needs on a fresh machine, then sync .venv.
#   1. uv (from PyPI into .tools/ when it is not on PATH);
#   2. PostgreSQL server binaries (initdb, pg_ctl) when missing: Debian's
#      package via apt-get when we are root, otherwise a message saying what to install;
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
  compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || compgen -G '/usr/pgsql-*/bin/initdb' >/dev/null
}
if [ -n "${SOKUTATSU_PG_DSN:-}" ]; then
  : # an external PostgreSQL is given; no binaries needed
elif ! have_pg; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing PostgreSQL server binaries (Debian package postgresql)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq --no-install-recommends postgresql >/dev/null \
      || fail "apt-get install postgresql failed"
  else
    fail "PostgreSQL server binaries (initdb, pg_ctl) are missing: install them (Debian/Ubuntu: sudo apt-get install postgresql; Fedora: sudo dnf install postgresql-server; macOS: brew install postgresql), or set SOKUTATSU_PG_BINDIR, or set SOKUTATSU_PG_DSN to use an existing server"
  fi
fi
if [ "$(id -u)" = 0 ] && [ -z "${SOKUTATSU_PG_DSN:-}" ] && ! id postgres >/dev/null 2>&1; then
  fail "running as root, PostgreSQL must run as the 'postgres' user, which does not exist: useradd --system postgres"
fi

# -- Python environment ------------------------------------------------------
export UV_PYTHON_DOWNLOADS=never UV_NATIVE_TLS=1
"$UV" sync --locked --quiet || fail "uv sync failed (is Python 3.11 installed? is uv.lock current? run: uv lock)"
