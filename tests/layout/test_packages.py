"""What each distribution brings (issue #22): the CLI, and so the runtime image, carries none of
the benchmarks', the demo's or Spark's dependencies; those come with sokutatsu-bench,
sokutatsu-demo and the CLI's analytics extra, whose commands join ``sokutatsu`` by entry points."""

from __future__ import annotations

import importlib.metadata as md
import re
import tomllib
from pathlib import Path
from typing import Any

import typer
from packaging.requirements import Requirement
from typer.testing import CliRunner

from sokutatsu.cli import plugins

ROOT = Path(__file__).resolve().parents[2]
# What the CLI must not pull in, by itself or through any member it depends on.
HEAVY = {"pyspark", "matplotlib", "aio-pika", "nats-py", "simpy"}
APART = {"sokutatsu-bench", "sokutatsu-demo", "sokutatsu-analytics"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _lock() -> dict[str, list[dict[str, Any]]]:
    """uv.lock's packages by name (a name may have several entries, one per resolution fork)."""
    found: dict[str, list[dict[str, Any]]] = {}
    for package in tomllib.loads((ROOT / "uv.lock").read_text())["package"]:
        found.setdefault(_norm(package["name"]), []).append(package)
    return found


def closure(root: str, extras: frozenset[str] = frozenset()) -> set[str]:
    """Every package uv.lock installs for ``root`` with ``extras``, following each dependency's extras."""
    lock = _lock()
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(_norm(root), extras)]
    while todo:
        name, wanted = todo.pop()
        if (name, wanted) in seen:
            continue
        seen.add((name, wanted))
        for entry in lock[name]:
            deps = list(entry.get("dependencies", []))
            for extra in wanted:
                deps += entry.get("optional-dependencies", {}).get(extra, [])
            todo += [(_norm(d["name"]), frozenset(d.get("extra", []))) for d in deps]
    return {name for name, _ in seen}


def test_the_cli_distribution_declares_none_of_them() -> None:
    """The installed metadata of sokutatsu-cli: analytics only behind its extra, the rest nowhere."""
    requires = [Requirement(r) for r in md.requires("sokutatsu-cli") or []]
    plain = {_norm(r.name) for r in requires if r.marker is None}
    behind_extra = {_norm(r.name): str(r.marker) for r in requires if r.marker is not None}
    assert plain, "sokutatsu-cli declares no dependencies: is it installed?"
    assert not plain & (HEAVY | APART), f"sokutatsu-cli depends on {sorted(plain & (HEAVY | APART))}"
    assert set(behind_extra) == {"sokutatsu-analytics"}, behind_extra
    assert behind_extra["sokutatsu-analytics"] == 'extra == "analytics"'


def test_the_lock_installs_none_of_them_with_the_cli() -> None:
    """Transitively, through the services it runs: what the runtime image gets from uv.lock."""
    runtime = closure("sokutatsu-cli")
    assert {"sokutatsu-core", "sokutatsu-broker", "typer", "grpcio"} <= runtime, sorted(runtime)
    assert not runtime & (HEAVY | APART), f"sokutatsu-cli brings {sorted(runtime & (HEAVY | APART))}"
    # The walk does find them where they are: behind the extra, and in the members apart.
    assert {"sokutatsu-analytics", "pyspark", "matplotlib"} <= closure("sokutatsu-cli", frozenset({"analytics"}))
    assert closure("sokutatsu-bench") >= HEAVY
    assert "pyspark" in closure("sokutatsu-demo")
    # The development environment (make test, make bench, make demo) still has everything.
    assert closure("sokutatsu-workspace") >= HEAVY | APART


def test_each_command_apart_comes_from_its_distribution() -> None:
    """The sokutatsu.commands entry points the workspace installs: one per command the CLI knows."""
    points = {p.name: p for p in md.entry_points(group=plugins.GROUP)}
    assert set(points) == set(plugins.KNOWN)
    for name, point in points.items():
        assert point.dist is not None
        assert _norm(point.dist.name) == plugins.KNOWN[name][0], f"{name} comes from {point.dist.name}"
        assert point.load() is not None


def _up() -> None:
    """A command of the CLI's own, so that the command added is a subcommand."""


def test_a_command_whose_distribution_is_missing_says_what_to_install() -> None:
    app = typer.Typer()
    app.command("up")(_up)
    plugins.add_command(app, "bench", found=[])
    listed = CliRunner().invoke(app, ["--help"])
    assert "(Not installed: sokutatsu-bench)" in listed.output
    for args in (["bench"], ["bench", "throughput", "--quick"], ["bench", "--help"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert "`sokutatsu bench` comes with sokutatsu-bench, which is not installed: pip install sokutatsu-bench" in (
            result.output
        )


def test_a_command_that_does_not_load_says_so() -> None:
    app = typer.Typer()
    app.command("up")(_up)
    broken = md.EntryPoint(name="demo", value="sokutatsu.demo.no_such_module:demo", group=plugins.GROUP)
    plugins.add_command(app, "demo", found=[broken])
    result = CliRunner().invoke(app, ["demo", "--quick"])
    assert result.exit_code == 2, result.output
    assert "`sokutatsu demo` cannot be loaded from sokutatsu-demo" in result.output
    assert "sokutatsu.demo.no_such_module" in result.output
