"""Commands other distributions add to ``sokutatsu``: ``bench`` and ``simulate`` (sokutatsu-bench),
``demo`` (sokutatsu-demo).

Each names its command in the ``sokutatsu.commands`` entry-point group, as a Typer app (a group
of subcommands) or a function (one command). The CLI depends on none of them, nor on what they
bring (matplotlib, aio-pika, nats-py, simpy, pyspark): where one is not installed, its command is
still listed, and running it says which distribution to install.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib.metadata import EntryPoint, entry_points

import typer
from rich.console import Console

GROUP = "sokutatsu.commands"
# Command -> the distribution that provides it, and what the command does (for --help when it is missing).
KNOWN: dict[str, tuple[str, str]] = {
    "demo": (
        "sokutatsu-demo",
        "Run the suite with a market-data scenario, analyse its traces, print what was measured.",
    ),
    "bench": ("sokutatsu-bench", "Benchmarks that print figures and write JSON."),
    "simulate": ("sokutatsu-bench", "Discrete-event simulations of the seeds' experiments."),
}

err = Console(stderr=True, highlight=False, soft_wrap=True)


def add_command(app: typer.Typer, name: str, found: Iterable[EntryPoint] | None = None) -> None:
    """Register ``name`` from its entry point (``found``: the group's, by default the installed ones);
    where there is none, or it does not load, a stand-in that says what to install."""
    distribution, summary = KNOWN[name]
    candidates = entry_points(group=GROUP) if found is None else found
    point = next((p for p in candidates if p.name == name), None)
    if point is None:
        _stand_in(
            app,
            name,
            f"(Not installed: {distribution}) {summary}",
            f"`sokutatsu {name}` comes with {distribution}, which is not installed: "
            f"pip install {distribution} (in the repository: make setup)",
        )
        return
    try:
        command = point.load()
    except ImportError as exc:
        _stand_in(
            app,
            name,
            f"(Cannot load {distribution}) {summary}",
            f"`sokutatsu {name}` cannot be loaded from {distribution} ({exc}): "
            f"reinstall {distribution} (in the repository: make setup)",
        )
        return
    if isinstance(command, typer.Typer):
        app.add_typer(command, name=name)
    else:
        app.command(name)(command)


def _stand_in(app: typer.Typer, name: str, summary: str, message: str) -> None:
    """A command that takes any arguments, ``--help`` included, and fails with ``message`` (exit status 2)."""

    def missing() -> None:
        err.print(f"sokutatsu: error: {message}", markup=False)
        raise typer.Exit(2)

    app.command(
        name,
        help=summary,
        short_help=summary,
        add_help_option=False,
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )(missing)
