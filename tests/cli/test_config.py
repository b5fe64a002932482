"""The settings registry in core matches the settings classes of the suite."""

from __future__ import annotations

from sokutatsu.cli.settings import ALL_SETTINGS
from sokutatsu.core.runtime_settings import LAUNCHER_NAMES, SERVICE_PREFIXES, RuntimeSettings
from sokutatsu.core.settings import describe


def test_core_registry_covers_every_settings_class() -> None:
    """Core cannot import the services, so it lists their prefixes; every class must be covered by it."""
    runtime_names = {k.env for k in describe(RuntimeSettings)}
    global_names: set[str] = set()
    for title, cls in ALL_SETTINGS:
        if cls.env_prefix == "SOKUTATSU_":
            global_names |= {k.env for k in describe(cls)}
        else:
            assert cls.env_prefix in SERVICE_PREFIXES, f"{title}: add {cls.env_prefix} to SERVICE_PREFIXES"
            assert cls.check_unknown, f"{title}: a class owning a prefix checks the names under it"
    assert global_names - runtime_names == set(LAUNCHER_NAMES)


def test_every_registered_prefix_has_a_settings_class() -> None:
    assert set(SERVICE_PREFIXES) == {cls.env_prefix for _, cls in ALL_SETTINGS} - {"SOKUTATSU_"}
