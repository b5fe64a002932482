from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from sokutatsu.core.runtime_settings import RuntimeSettings
from sokutatsu.core.settings import (
    Settings,
    SettingsError,
    describe,
    load,
    parse_address,
    parse_size,
    setting,
)
from tests.helpers import run_once

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Example(Settings):
    env_prefix: ClassVar[str] = "EXAMPLE_"

    name: str = setting("NAME", "alpha", "A name.")
    count: int = setting("COUNT", 3, "How many.")
    ratio: float = setting("RATIO", 0.5, "A share.")
    enabled: bool = setting("ENABLED", False, "Whether on.")
    budget: int = setting("BUDGET", 1024, "Bytes.", parse_size)
    listen: str = setting("LISTEN", "127.0.0.1:1", "Where.", parse_address)


def test_defaults_when_nothing_is_set() -> None:
    assert load(Example, {}) == Example()


def test_values_are_parsed() -> None:
    got = load(
        Example,
        {
            "EXAMPLE_NAME": "beta",
            "EXAMPLE_COUNT": "7",
            "EXAMPLE_RATIO": "2.5",
            "EXAMPLE_ENABLED": "yes",
            "EXAMPLE_BUDGET": "64MiB",
            "EXAMPLE_LISTEN": "0.0.0.0:0",
        },
    )
    assert got == Example(name="beta", count=7, ratio=2.5, enabled=True, budget=64 * 2**20, listen="0.0.0.0:0")


@pytest.mark.parametrize(
    ("var", "value", "says"),
    [
        ("EXAMPLE_COUNT", "seven", "whole number"),
        ("EXAMPLE_RATIO", "-1", "greater than 0"),
        ("EXAMPLE_ENABLED", "maybe", "true or false"),
        ("EXAMPLE_BUDGET", "12 parsecs", "size"),
        ("EXAMPLE_LISTEN", "localhost", "host:port"),
        ("EXAMPLE_LISTEN", "127.0.0.1:70000", "host:port"),
    ],
)
def test_malformed_value_names_the_variable(var: str, value: str, says: str) -> None:
    with pytest.raises(SettingsError) as info:
        load(Example, {var: value})
    message = str(info.value)
    assert message.startswith(f"{var}={value!r}")
    assert says in message
    assert "\n" not in message


def test_unknown_variable_under_the_prefix_suggests_the_known_one() -> None:
    with pytest.raises(SettingsError, match="EXAMPLE_CUONT: unknown variable; did you mean EXAMPLE_COUNT"):
        load(Example, {"EXAMPLE_CUONT": "1"})


def test_variables_outside_the_prefix_are_ignored() -> None:
    assert load(Example, {"OTHER_THING": "x"}) == Example()


def test_describe_lists_every_knob_with_default_and_doc() -> None:
    knobs = {k.env: k for k in describe(Example)}
    assert set(knobs) == {f"EXAMPLE_{n}" for n in ("NAME", "COUNT", "RATIO", "ENABLED", "BUDGET", "LISTEN")}
    assert knobs["EXAMPLE_ENABLED"].default == "false"
    assert all(k.doc for k in knobs.values())


def test_runtime_settings_parse_paths() -> None:
    got = load(RuntimeSettings, {"SOKUTATSU_TRACE_DIR": "/var/lib/traces", "SOKUTATSU_LOG_LEVEL": "debug"})
    assert got.trace_dir == Path("/var/lib/traces")
    assert got.log_level == "DEBUG"


@pytest.mark.parametrize(
    ("env", "var"),
    [
        ({"SOKUTATSU_GRACE_SECONDS": "soon"}, "SOKUTATSU_GRACE_SECONDS"),
        ({"SOKUTATSU_BROKER_LISTEN": "nowhere"}, "SOKUTATSU_BROKER_LISTEN"),
        ({"SOKUTATSU_BROKER_LISTN": "127.0.0.1:0"}, "SOKUTATSU_BROKER_LISTN"),
        ({"SOKUTATSU_LOG_LEVEL": "loud"}, "SOKUTATSU_LOG_LEVEL"),
        ({"SOKUTATSU_STATEDIR": "state"}, "SOKUTATSU_STATEDIR"),
    ],
)
def test_service_refuses_bad_settings_with_one_line_and_status_2(env: dict[str, str], var: str) -> None:
    result = run_once("sokutatsu.broker", env)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("sokutatsu-broker: error: ")
    assert var in lines[0]


@pytest.mark.parametrize(
    ("var", "meant"),
    [
        ("SOKUTATSU_GRACE_SECOND", "SOKUTATSU_GRACE_SECONDS"),
        ("SOKUTATSU_STATEDIR", "SOKUTATSU_STATE_DIR"),
        ("SOKUTATSU_LOGLEVEL", "SOKUTATSU_LOG_LEVEL"),
        ("SOKUTATSU_BROKR_LISTEN", "SOKUTATSU_BROKER_LISTEN"),
        ("SOKUTATSU_QUEUE_DB_DSN", "SOKUTATSU_QUEUEDB_DSN"),
    ],
)
def test_a_sokutatsu_variable_nobody_reads_is_refused_with_a_hint(var: str, meant: str) -> None:
    with pytest.raises(SettingsError) as info:
        load(RuntimeSettings, {var: "1"})
    assert str(info.value) == f"{var}: unknown variable; did you mean {meant}?"


def test_an_unknown_variable_without_a_close_name_lists_the_known_ones() -> None:
    with pytest.raises(SettingsError) as info:
        load(RuntimeSettings, {"SOKUTATSU_XYZZY": "1"})
    message = str(info.value)
    assert message.startswith("SOKUTATSU_XYZZY: unknown variable; known: SOKUTATSU_ALLOW_PLAINTEXT, ")
    assert "SOKUTATSU_STATE_DIR" in message
    assert "SOKUTATSU_BROKER_" in message
    assert "\n" not in message


def test_variables_of_other_settings_classes_are_not_unknown() -> None:
    """The launcher's names and everything under a service prefix belong to other classes (which check them)."""
    env = {
        "SOKUTATSU_STATE_DIR": "state",
        "SOKUTATSU_PG_DSN": "",
        "SOKUTATSU_BROKER_WHATEVER": "checked by the broker",
        "SOKUTATSU_MONITOR_LISTEN": "127.0.0.1:0",
        "SOKUTATSU_SEQUENCER_LISTEN": "127.0.0.1:0",
        "SOKUTATSU_QUEUEDB_DSN": "x",
        "SOKUTATSU_PARENT_PID": "1",
    }
    assert load(RuntimeSettings, env) == RuntimeSettings(parent_pid=1)


def test_every_process_refuses_an_unknown_sokutatsu_variable() -> None:
    result = run_once("sokutatsu.monitor", {"SOKUTATSU_MONITOR_LISTEN": "127.0.0.1:0", "SOKUTATSU_GRACE_SECOND": "1"})
    assert result.returncode == 2
    assert result.stderr == (
        "sokutatsu-monitor: error: SOKUTATSU_GRACE_SECOND: unknown variable; did you mean SOKUTATSU_GRACE_SECONDS?\n"
    )


def test_configuration_reference_is_current() -> None:
    """docs/configuration.md is what `sokutatsu config --markdown` prints (regenerate it if this fails)."""
    printed = subprocess.run(
        [sys.executable, "-m", "sokutatsu.cli", "config", "--markdown"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert printed == (ROOT / "docs" / "configuration.md").read_text()
