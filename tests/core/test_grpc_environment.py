"""gRPC's environment (core/grpc_environment.py): every service's entry point sets it before grpc loads,
and a value its starter gave is kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sokutatsu.core import grpc_environment

# Each entry point, and a setting that makes it stop once its modules are loaded (before it serves).
ENTRY_POINTS = {
    "sokutatsu.broker": "SOKUTATSU_BROKER_LISTEN",
    "sokutatsu.monitor": "SOKUTATSU_MONITOR_LISTEN",
    "sokutatsu.sequencer": "SOKUTATSU_SEQUENCER_LISTEN",
    "sokutatsu.queuedb": "SOKUTATSU_QUEUEDB_LISTEN",
    "sokutatsu.queuedb.transferd": "SOKUTATSU_TRANSFER_LISTEN",
}


# Runs an entry point as ``python -m`` does, after a finder that prints gRPC's environment at the moment
# grpc starts to be imported (and stays out of the way otherwise).
WATCH = """
import os, runpy, sys

class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "grpc":
            sys.meta_path.remove(self)
            print("at grpc's import:", {k: os.environ.get(k) for k in ("GRPC_VERBOSITY", "GRPC_EXPERIMENTS")})
        return None

sys.meta_path.insert(0, Watch())
runpy.run_module(sys.argv[1], run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_an_entry_point_sets_grpc_s_environment_before_grpc_loads(module: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in grpc_environment.DEFAULTS}
    env[ENTRY_POINTS[module]] = "not-an-address"
    result = subprocess.run(
        [sys.executable, "-c", WATCH, module], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "not-an-address" in result.stderr.splitlines()[-1]  # it stopped at its settings, after its imports
    assert result.stdout.splitlines() == [f"at grpc's import: {grpc_environment.DEFAULTS}"]


def test_a_value_given_by_the_starter_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRPC_EXPERIMENTS", "")
    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    grpc_environment.apply()
    assert os.environ["GRPC_EXPERIMENTS"] == ""  # given: gRPC's own defaults
    assert os.environ["GRPC_VERBOSITY"] == "NONE"  # not given: ours


def test_importing_the_modules_that_read_it_sets_nothing() -> None:
    """Only a service's entry point sets gRPC's environment: the CLI (and the processes it starts, such as the
    benchmarks' clients), the benchmarks and a test importing the transfer daemon's module keep the one they got."""
    env = {k: v for k, v in os.environ.items() if k not in grpc_environment.DEFAULTS}
    modules = "sokutatsu.cli.app, sokutatsu.bench.grpc_cost, sokutatsu.queuedb.transferd"
    code = f"import os, {modules}; print(sorted(k for k in ('GRPC_VERBOSITY', 'GRPC_EXPERIMENTS') if k in os.environ))"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"
