"""``sokutatsu-client`` on its own, as an application installs it.

Into an empty virtualenv (no project code, no workspace packages), ``uv pip install ./libs/client``
brings the SDK, grpcio, protobuf and their own dependencies, and nothing else (no psycopg, no
OpenTelemetry, no gRPC health or reflection, no sokutatsu-core); the README's SDK examples then
run from that environment, unchanged but for the addresses, against ``sokutatsu up``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_launcher import E2E_TIMEOUT_SECONDS, Launch, launch  # noqa: F401 - launch is the fixture

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(E2E_TIMEOUT_SECONDS)]

ROOT = Path(__file__).resolve().parents[2]
# Bounds that only stop a hung step; nothing asserts on durations.
INSTALL_LIMIT_SECONDS = 300
EXAMPLE_LIMIT_SECONDS = 60
# What an application would never expect the SDK to pull in.
FORBIDDEN = ("sokutatsu-core", "psycopg", "opentelemetry", "grpcio-health", "grpcio-reflection", "tenacity")

# Run with the virtualenv's Python: the installed distributions, and the dependency closure of
# grpcio and protobuf by their own metadata (requirements behind an extra left out).
_INSPECT = r"""
import importlib.metadata as md, json, re
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
installed = {norm(d.metadata["Name"]): d.version for d in md.distributions()}
closure, todo = set(), ["grpcio", "protobuf"]
while todo:
    name = norm(todo.pop())
    if name in closure:
        continue
    closure.add(name)
    try:
        requires = md.requires(name) or []
    except md.PackageNotFoundError:
        continue
    todo += [re.match(r"[A-Za-z0-9._-]+", r).group(0) for r in requires if "extra ==" not in r]
print(json.dumps({"installed": installed, "closure": sorted(closure)}))
"""


def _uv() -> str:
    found = shutil.which("uv") or str(ROOT / ".tools" / "bin" / "uv")
    assert Path(found).exists(), "uv is not on PATH nor in .tools/bin: run `make setup`"
    return found


def _clean_env() -> dict[str, str]:
    """The environment without the workspace's virtualenv or path settings."""
    env = {k: v for k, v in os.environ.items() if k not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"}}
    env["UV_PYTHON_DOWNLOADS"] = "never"
    return env


def _run(args: list[str], *, timeout: float, cwd: Path) -> str:
    result = subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, check=False, env=_clean_env(), cwd=cwd
    )
    assert result.returncode == 0, f"{args}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _readme_sdk_examples() -> list[str]:
    """The README's Python blocks that use the SDK."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.DOTALL)
    return [b for b in blocks if "from sokutatsu.client import" in b]


def _with_addresses(example: str, endpoints: dict[str, str]) -> str:
    """The example with the suite's addresses in place of `make up`'s fixed ports."""
    replacements = {
        'BROKERS = ["127.0.0.1:7201", "127.0.0.1:7202"]': (
            f"BROKERS = [{endpoints['broker-a']!r}, {endpoints['broker-b']!r}]"
        ),
        'SEQUENCERS = {"a": "127.0.0.1:7101", "b": "127.0.0.1:7102"}': (
            f"SEQUENCERS = {{'a': {endpoints['seq-a']!r}, 'b': {endpoints['seq-b']!r}}}"
        ),
    }
    assert 'BROKERS = ["127.0.0.1:7201", "127.0.0.1:7202"]' in example, "the example names the brokers by BROKERS"
    for old, new in replacements.items():
        example = example.replace(old, new)
    assert "127.0.0.1:7" not in example, f"an address the test does not replace:\n{example}"
    return example


def test_the_client_installs_alone_and_runs_the_readme_examples(
    launch: Launch,  # noqa: F811 - the fixture imported above
    pg_dsn: str,
    tmp_path: Path,
) -> None:
    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    uv = _uv()
    # The machine's interpreter, not the workspace's virtualenv (a symlink to it).
    _run([uv, "venv", "--python", os.path.realpath(sys.executable), str(venv)], timeout=60, cwd=tmp_path)
    install = [uv, "pip", "install", "--python", str(python), str(ROOT / "libs" / "client")]
    # uv's cache is the wheelhouse (the workspace was installed from it); the index only when it lacks something.
    offline = subprocess.run(
        [*install, "--offline"],
        capture_output=True,
        text=True,
        timeout=INSTALL_LIMIT_SECONDS,
        check=False,
        env=_clean_env(),
    )
    if offline.returncode != 0:
        _run(install, timeout=INSTALL_LIMIT_SECONDS, cwd=tmp_path)

    found = json.loads(_run([str(python), "-I", "-c", _INSPECT], timeout=60, cwd=tmp_path))
    installed: dict[str, str] = found["installed"]
    listing = ", ".join(f"{name} {version}" for name, version in sorted(installed.items()))
    print(f"installed into the empty virtualenv: {listing}")  # noqa: T201 - the list, for the record
    assert {"sokutatsu-client", "grpcio", "protobuf"} <= set(installed), listing
    extra = set(installed) - {"sokutatsu-client", *found["closure"]}
    assert not extra, f"not grpcio, protobuf or their dependencies: {sorted(extra)} (installed: {listing})"
    assert not [n for n in installed if n.startswith(FORBIDDEN)], listing

    # The installed copy, not the working tree: typed, and without the services' runtime.
    where = _run(
        [str(python), "-I", "-c", "import sokutatsu.client as c, sokutatsu.ordering as o; print(c.__file__)"],
        timeout=60,
        cwd=tmp_path,
    ).strip()
    assert Path(where).is_relative_to(venv), where
    assert (Path(where).parent / "py.typed").exists()
    missing = subprocess.run(
        [str(python), "-I", "-c", "import sokutatsu.core"], capture_output=True, text=True, check=False, cwd=tmp_path
    )
    assert "ModuleNotFoundError" in missing.stderr, missing

    examples = _readme_sdk_examples()
    assert len(examples) == 2, "the README shows the SDK in two blocks: publish/subscribe, total order"
    launcher = launch("up", "--ports", "auto", state=tmp_path / "state", env={"SOKUTATSU_PG_DSN": pg_dsn})
    endpoints = {e["name"]: e["address"] for e in launcher.wait_up()}
    outputs = []
    for n, example in enumerate(examples):
        script = tmp_path / f"example{n}.py"
        script.write_text(_with_addresses(example, endpoints))
        outputs.append(_run([str(python), "-I", str(script)], timeout=EXAMPLE_LIMIT_SECONDS, cwd=tmp_path))
    assert outputs[0] == "7203.T b'2890' TSE\n"
    lines = outputs[1].splitlines()
    assert sorted(line.split()[0] for line in lines) == ["a", "b"], outputs[1]
    assert sorted(line.split(" ", 2)[2] for line in lines) == ["b'buy 100'", "b'sell 50'"], outputs[1]
    _, err = launcher.stop()
    assert launcher.process.returncode == 0, err
