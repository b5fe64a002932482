#!/bin/sh
# The stand-in postgres:15 image's entrypoint (postgres.Containerfile): what the official
# image's entrypoint does with POSTGRES_USER, POSTGRES_PASSWORD and POSTGRES_DB, for a
# command that starts with `postgres`; any other command runs as given.
set -eu

if [ "${1:-}" != postgres ]; then
    exec "$@"
fi

: "${PGDATA:=/var/lib/postgresql/data}"
: "${POSTGRES_USER:=postgres}"
: "${POSTGRES_DB:=$POSTGRES_USER}"

if [ "$(id -u)" = 0 ]; then
    # A new named volume may come with root's ownership: give it to the server's user.
    mkdir -p "$PGDATA" /var/run/postgresql
    chown -R postgres:postgres "$PGDATA" /var/run/postgresql
    chmod 0700 "$PGDATA"
    exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" "$@"
fi

if [ ! -s "$PGDATA/PG_VERSION" ]; then
    if [ -z "${POSTGRES_PASSWORD:-}" ]; then
        echo "stand-in postgres: POSTGRES_PASSWORD is not set (the official image refuses that too)" >&2
        exit 1
    fi
    pwfile=$(mktemp)
    printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
    initdb --username="$POSTGRES_USER" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 \
        --encoding=UTF8 -D "$PGDATA" >/dev/null
    rm -f "$pwfile"
    # Password logins from anywhere, as the official image allows when a password is set.
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    echo "listen_addresses = '*'" >> "$PGDATA/postgresql.conf"
    # The first-run server answers on its socket only, as the official image's does.
    pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
    if [ "$POSTGRES_DB" != postgres ]; then
        echo 'CREATE DATABASE :"db";' | psql -v ON_ERROR_STOP=1 --username="$POSTGRES_USER" \
            --dbname=postgres --set=db="$POSTGRES_DB" >/dev/null
    fi
    pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
    echo "stand-in postgres: initialised $PGDATA (user $POSTGRES_USER, database $POSTGRES_DB)"
fi

exec "$@"
