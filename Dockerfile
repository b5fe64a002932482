# syntax=docker/dockerfile:1
# Sokutatsu images (see docs/docker.md; docker-compose.yml builds both targets):
#   runtime    every service (python -m sokutatsu.<service>) and the sokutatsu command: the
#              sokutatsu-cli member and its dependencies, without its analytics extra (no Spark)
#              and without the benchmarks and the demo (sokutatsu-bench, sokutatsu-demo)
#   analytics  the same plus sokutatsu-cli[analytics] (pyspark) and a Java 17 runtime (sokutatsu analyze)
# Each is installed from uv.lock exactly (uv sync --locked --package sokutatsu-cli), without the dev tools.

# The same interpreter path in every stage: the virtual environment is copied, not rebuilt.
# Bookworm because it ships openjdk-17-jre-headless (the analytics stage).
# Every image this file starts from is a build argument with the public image as its default,
# so a site with its own registry mirror builds without editing files (docs/docker.md):
#   PYTHON_IMAGE  Python 3.11 on Debian bookworm, as python:3.11-slim-bookworm is
#   UV_IMAGE      an image holding the uv binaries at /uv and /uvx
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# The uv that writes uv.lock in this repository (make setup installs the same line).
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.13.9

FROM ${UV_IMAGE} AS uv

# uv's package cache for the install steps. By default this stage is empty and uv downloads
# from the index uv.lock names, into a cache mount kept between builds. A build that cannot
# download (an air-gapped site; scripts/compose_check.sh, where downloads inside containers
# fail) is handed a filled uv cache instead, `--build-context uv-cache=DIR` (a named context
# replaces the stage of the same name), and installs from it offline.
FROM scratch AS uv-cache

# ------------------------------------------------------------------ builder --
FROM ${PYTHON_IMAGE} AS builder
COPY --from=uv /uv /uvx /bin/
# Compile bytecode at build time (the runtime's venv is read-only for the service user);
# copy, not hard-link, out of the cache mount; never download an interpreter.
ENV UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_PYTHON_DOWNLOADS=never \
    UV_PROJECT_ENVIRONMENT=/app/.venv
WORKDIR /src

# 1. Third-party dependencies only: this layer is rebuilt when uv.lock or a pyproject.toml changes.
#    Every member's pyproject.toml, for uv checks the whole workspace against uv.lock; the sync
#    installs what sokutatsu-cli needs, nothing of the members it does not depend on.
COPY pyproject.toml uv.lock .python-version ./
COPY libs/client/pyproject.toml libs/client/README.md libs/client/
COPY libs/core/pyproject.toml libs/core/
COPY libs/cli/pyproject.toml libs/cli/
COPY libs/bench/pyproject.toml libs/bench/
COPY libs/demo/pyproject.toml libs/demo/
COPY services/broker/pyproject.toml services/broker/
COPY services/monitor/pyproject.toml services/monitor/
COPY services/sequencer/pyproject.toml services/sequencer/
COPY services/queue-db/pyproject.toml services/queue-db/
COPY analytics/pyproject.toml analytics/
RUN --mount=type=cache,target=/root/.cache/uv \
    --mount=type=bind,from=uv-cache,target=/uv-cache,rw \
    if [ -n "$(ls -A /uv-cache)" ]; then export UV_CACHE_DIR=/uv-cache UV_OFFLINE=1; fi \
    && uv sync --locked --no-dev --no-editable --no-install-workspace --package sokutatsu-cli

# 2. sokutatsu-cli and the members it depends on, installed as wheels (--no-editable), so the venv
#    needs no source tree.
COPY libs/ libs/
COPY services/ services/
COPY analytics/ analytics/
RUN --mount=type=cache,target=/root/.cache/uv \
    --mount=type=bind,from=uv-cache,target=/uv-cache,rw \
    if [ -n "$(ls -A /uv-cache)" ]; then export UV_CACHE_DIR=/uv-cache UV_OFFLINE=1; fi \
    && uv sync --locked --no-dev --no-editable --package sokutatsu-cli

# 3. The analytics image's environment: the same plus the extra (sokutatsu-analytics, pyspark).
FROM builder AS analytics-builder
RUN --mount=type=cache,target=/root/.cache/uv \
    --mount=type=bind,from=uv-cache,target=/uv-cache,rw \
    if [ -n "$(ls -A /uv-cache)" ]; then export UV_CACHE_DIR=/uv-cache UV_OFFLINE=1; fi \
    && uv sync --locked --no-dev --no-editable --package sokutatsu-cli --extra analytics

# --------------------------------------------------------------------- base --
FROM ${PYTHON_IMAGE} AS base
# A fixed, unprivileged user. The folders that docker-compose.yml mounts volumes on are created
# here and owned by it: Docker gives a new named volume the ownership of its mount point.
RUN groupadd --system --gid 10001 sokutatsu \
    && useradd --system --uid 10001 --gid sokutatsu --create-home --home-dir /home/sokutatsu sokutatsu \
    && mkdir -p /state /traces /reports /cluster \
    && chown sokutatsu:sokutatsu /state /traces /reports \
    && chmod 0700 /cluster && chown sokutatsu:sokutatsu /cluster
ENV PATH=/app/.venv/bin:$PATH \
    PYTHONUNBUFFERED=1
WORKDIR /home/sokutatsu

# ------------------------------------------------------------------ runtime --
FROM base AS runtime
# Owned by root: the service user can run it, not change it.
COPY --from=builder /app/.venv /app/.venv
USER sokutatsu
# docker-compose.yml gives each service its command (python -m sokutatsu.<service>).
CMD ["sokutatsu", "--help"]

# ---------------------------------------------------------------- analytics --
FROM base AS analytics
# pyspark 4 needs Java 17 or later. Slim images lack the man folder the JRE's package
# registers its pages in, so it is created first.
RUN mkdir -p /usr/share/man/man1 \
    && apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
    && rm -rf /var/lib/apt/lists/*
COPY --from=analytics-builder /app/.venv /app/.venv
USER sokutatsu
CMD ["sokutatsu", "analyze", "--traces", "/traces", "--out", "/reports"]
