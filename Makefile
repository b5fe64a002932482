# Sokutatsu: `make help` lists the targets. Every target installs what it needs first.
SHELL := /bin/bash
.DEFAULT_GOAL := help

# uv from PATH, else the copy `make setup` installs under .tools/.
UV := $(shell command -v uv 2>/dev/null || echo $(CURDIR)/.tools/bin/uv)
# Python comes from the machine (3.11); never download an interpreter.
export UV_PYTHON_DOWNLOADS := never
# Trust the system's certificate store (as pip and curl do), e.g. behind a TLS-inspecting proxy.
# (UV_SYSTEM_CERTS replaces the deprecated UV_NATIVE_TLS; scripts/setup.sh falls back for an old uv.)
export UV_SYSTEM_CERTS := 1
RUN := $(UV) run --locked --no-sync
# Python writes the bytecode of the project's own modules and pytest that of the rewritten test
# modules, even where the machine sets PYTHONDONTWRITEBYTECODE: else every one of the ~700
# processes a test run starts compiles them from source again (scripts/setup.sh, README.md).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: help setup protos lint test up demo bench chaos compose-check

help: ## List the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-z-]+:.*## / {printf "  make %-14s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

setup: ## Install uv and PostgreSQL binaries if missing; sync .venv from uv.lock
	@scripts/setup.sh

protos: setup ## Regenerate the gRPC stubs in libs/core from protos/ (never edit them by hand)
	$(RUN) python scripts/gen_protos.py

lint: setup ## ruff format check, ruff lint, mypy --strict
	$(RUN) ruff format --check .
	$(RUN) ruff check .
	$(RUN) mypy

# Test processes (pytest-xdist workers): most tests wait on processes and sockets, so more
# workers than cores pays; TEST_WORKERS=0 runs everything in this one process (tests/fix_schedule.py).
# Tests marked solo (whole fault schedules) run afterwards, alone.
TEST_WORKERS ?= 4

test: setup ## Run every test (real PostgreSQL, gRPC servers and processes) on TEST_WORKERS workers (4), then the solo ones; fails if none ran
	@$(RUN) pytest -n $(TEST_WORKERS) --dist loadgroup -m "not solo"; parallel=$$?; \
	$(RUN) pytest -m solo; solo=$$?; \
	for status in $$parallel $$solo; do \
	  if [ $$status -eq 5 ]; then echo "make test: a pytest run collected no tests: that is a failure" >&2; exit 1; fi; \
	  if [ $$status -ne 0 ]; then exit $$status; fi; \
	done

up: setup ## Run the whole suite as local processes on an embedded PostgreSQL (Ctrl-C stops it)
	$(RUN) sokutatsu up

demo: setup ## The main job: the suite on an embedded PostgreSQL, a market-data scenario, its traces analysed (docs/demo.md)
	$(RUN) sokutatsu demo

bench: setup ## Benchmarks, figures to bench/results/ (QUICK=1 for a smoke run of a few minutes)
	$(RUN) sokutatsu bench throughput $(if $(QUICK),--quick) --json bench/results/throughput$(if $(QUICK),-quick).json
	$(RUN) sokutatsu bench switchover $(if $(QUICK),--quick) --json bench/results/switchover$(if $(QUICK),-quick).json
	$(RUN) sokutatsu bench slow-subscriber $(if $(QUICK),--quick) --json bench/results/slow-subscriber$(if $(QUICK),-quick).json --plots bench/results/plots$(if $(QUICK),-quick)
	$(RUN) sokutatsu bench peers $(if $(QUICK),--quick) --json bench/results/peers$(if $(QUICK),-quick).json
	$(RUN) sokutatsu bench sequencer $(if $(QUICK),--quick) --json bench/results/sequencer$(if $(QUICK),-quick).json
	$(RUN) sokutatsu bench queue-db $(if $(QUICK),--quick) --json bench/results/queue-db$(if $(QUICK),-quick).json
	$(RUN) sokutatsu bench throughput --tracing $(if $(QUICK),--quick) --json bench/results/throughput-tracing$(if $(QUICK),-quick).json
	$(RUN) sokutatsu bench analytics $(if $(QUICK),--spans 100000) --json bench/results/analytics$(if $(QUICK),-quick).json
	$(RUN) sokutatsu bench soak $(if $(QUICK),--quick) --json bench/results/soak$(if $(QUICK),-quick).json
	$(RUN) sokutatsu bench fanout $(if $(QUICK),--quick) --json bench/results/fanout$(if $(QUICK),-quick).json --plots bench/results/plots$(if $(QUICK),-quick)
	$(RUN) sokutatsu bench grpc-cost $(if $(QUICK),--quick) --json bench/results/grpc-cost$(if $(QUICK),-quick).json

chaos: setup ## Fault schedules against the broker pair, checked; report to bench/results/ (SEEDS=3 MINUTES=1 DELIVERY_WORKERS=0)
	$(RUN) sokutatsu chaos --seeds $(or $(SEEDS),3) --minutes $(or $(MINUTES),1) --delivery-workers $(or $(DELIVERY_WORKERS),0)

compose-check: setup ## Build the images and run docker-compose.yml for real with podman and stand-in base images, checked (root; docs/docker.md)
	@scripts/compose_check.sh
