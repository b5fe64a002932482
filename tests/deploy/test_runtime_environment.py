"""The runtime image's environment, made as the Dockerfile makes it, without Docker (issue #22).

The Dockerfile's own ``uv sync`` for the runtime target runs into an empty virtual environment:
it holds the sokutatsu command and the services, none of the benchmarks', the demo's or Spark's
dependencies; there ``sokutatsu --help`` works, and ``bench``, ``simulate``, ``demo`` and
``analyze`` each say in one line what to install.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy.test_compose import syncs_of_target
from tests.layout.test_packages import APART, HEAVY, closure

pytestmark = [pytest.mark.slow, pytest.mark.timeout(360)]

ROOT = Path(__file__).resolve().parents[2]
# Bounds that only stop a hung step; nothing asserts on durations.
SYNC_LIMIT_SECONDS = 300
COMMAND_LIMIT_SECONDS = 60
_INSTALLED = (
    "import importlib.metadata as md, json, re;"
    "print(json.dumps(sorted({re.sub(r'[-_.]+', '-', d.metadata['Name']).lower() for d in md.distributions()})))"
)


def _uv() -> str:
    found = shutil.which("uv") or str(ROOT / ".tools" / "bin" / "uv")
    assert Path(found).exists(), "uv is not on PATH nor in .tools/bin: run `make setup`"
    return found


def _env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"}}
    env.update(UV_PROJECT_ENVIRONMENT=str(venv), UV_PYTHON_DOWNLOADS="never")
    return env


@pytest.fixture(scope="module")
def runtime_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("runtime") / "venv"
    sync = syncs_of_target("runtime")[-1].split()
    assert sync[:2] == ["uv", "sync"], sync
    # uv keeps the wheels it built of the workspace's members keyed on their pyproject.toml: rebuild
    # them from this tree's sources, as the image's build does.
    members = sorted(p for p in closure("sokutatsu-cli") if p.startswith("sokutatsu-"))
    refresh = [arg for member in members for arg in ("--refresh-package", member)]
    result = subprocess.run(
        [_uv(), *sync[1:], *refresh, "--quiet"],
        cwd=ROOT,
        env=_env(venv),
        capture_output=True,
        text=True,
        timeout=SYNC_LIMIT_SECONDS,
        check=False,
    )
    assert result.returncode == 0, f"{sync}: exit {result.returncode}\n{result.stderr}"
    return venv


def _run(venv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "bin" / args[0]), *args[1:]],
        env=_env(venv),
        cwd=venv.parent,
        capture_output=True,
        text=True,
        timeout=COMMAND_LIMIT_SECONDS,
        check=False,
    )


def test_it_holds_the_cli_and_the_services_and_nothing_apart(runtime_venv: Path) -> None:
    installed = set(json.loads(_run(runtime_venv, "python", "-c", _INSTALLED).stdout))
    assert {"sokutatsu-cli", "sokutatsu-broker", "sokutatsu-monitor", "sokutatsu-queue-db"} <= installed, installed
    assert not installed & (HEAVY | APART), f"the runtime image would carry {sorted(installed & (HEAVY | APART))}"


def test_the_command_lists_what_is_not_installed(runtime_venv: Path) -> None:
    result = _run(runtime_venv, "sokutatsu", "--help")
    assert result.returncode == 0, result.stderr
    for name, distribution in (
        ("demo", "sokutatsu-demo"),
        ("bench", "sokutatsu-bench"),
        ("simulate", "sokutatsu-bench"),
    ):
        listed = re.search(rf"│ {name} +\(Not installed: {distribution}\)", result.stdout)
        assert listed, f"{name}:\n{result.stdout}"


@pytest.mark.parametrize(
    ("args", "wanted"),
    [
        (["bench", "throughput", "--quick"], "pip install sokutatsu-bench"),
        (["simulate", "atop", "--figure", "10"], "pip install sokutatsu-bench"),
        (["demo", "--quick"], "pip install sokutatsu-demo"),
        (["analyze", "--traces", "traces", "--out", "out"], "pip install 'sokutatsu-cli[analytics]'"),
    ],
    ids=lambda v: v[0] if isinstance(v, list) else "",
)
def test_a_command_apart_says_what_to_install_in_one_line(runtime_venv: Path, args: list[str], wanted: str) -> None:
    result = _run(runtime_venv, "sokutatsu", *args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"sokutatsu: error: `sokutatsu {args[0]}` "), lines[0]
    assert wanted in lines[0], lines[0]
