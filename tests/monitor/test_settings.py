"""The monitor's settings that span two variables."""

from __future__ import annotations

import pytest

from sokutatsu.core.settings import SettingsError, load
from sokutatsu.monitor.settings import MonitorSettings

BROKERS = "broker-a=127.0.0.1:7201,broker-b=127.0.0.1:7202"


def test_broker_links_send_the_monitors_calls_elsewhere_and_keep_the_brokers_addresses() -> None:
    settings = load(
        MonitorSettings,
        {"SOKUTATSU_MONITOR_BROKERS": BROKERS, "SOKUTATSU_MONITOR_BROKER_LINKS": "broker-a=10.0.0.9:9201"},
    )
    assert settings.link_of("broker-a") == "10.0.0.9:9201"
    assert settings.link_of("broker-b") == "127.0.0.1:7202"  # not named: its address
    assert [e.address for e in settings.brokers] == ["127.0.0.1:7201", "127.0.0.1:7202"]


@pytest.mark.parametrize(
    ("links", "said"),
    [
        ("broker-c=127.0.0.1:1", "names 'broker-c', which is not a broker of SOKUTATSU_MONITOR_BROKERS"),
        ("broker-a=nowhere", "expected host:port"),
        ("broker-a=127.0.0.1:1,broker-a=127.0.0.1:2", "named twice"),
    ],
)
def test_broker_links_naming_no_broker_of_the_pair_are_refused(links: str, said: str) -> None:
    with pytest.raises(SettingsError, match=said):
        load(MonitorSettings, {"SOKUTATSU_MONITOR_BROKERS": BROKERS, "SOKUTATSU_MONITOR_BROKER_LINKS": links})
