"""The monitor's fixtures (``tests/monitor/fix_monitor.py``); ``broker_factory`` comes from the root conftest."""

from tests.monitor.fix_monitor import broker_pair, monitor_factory

__all__ = ["broker_pair", "monitor_factory"]
