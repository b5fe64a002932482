"""Both brokers of a pair stopped at once (issue #21, item 4): each must exit cleanly, without
an ERROR line (its watermark stream to the peer ending under a server that stops is the normal
end of a pair, not a failure), with status 0, and without waiting out its grace period for the
peer's stream (each used to hold its server open for the other's stream until the grace period
ran out, then log the stream's cancellation as an error)."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable

import pytest

from tests.broker.fix_broker import BrokerProcess, stats, until

pytestmark = pytest.mark.timeout(180)

# Far longer than the wait below: a broker that waits out its grace period is caught by the wait.
GRACE_SECONDS = "120"
EXIT_LIMIT_SECONDS = 30


async def _started_pair(broker_factory: Callable[..., BrokerProcess]) -> list[BrokerProcess]:
    a = broker_factory(instance="broker-a", role="active", peer_timeout_ms="500")
    a.env["SOKUTATSU_GRACE_SECONDS"] = GRACE_SECONDS
    a.start()
    b = broker_factory(instance="broker-b", role="standby", peer=a.address, peer_timeout_ms="500")
    b.env["SOKUTATSU_GRACE_SECONDS"] = GRACE_SECONDS
    b.start()

    async def heard() -> bool:
        return all(s.peer_up and s.caught_up for s in [await stats(a.address), await stats(b.address)])

    await until(heard, "the brokers of the pair to hear each other and be caught up")
    return [a, b]


@pytest.mark.parametrize("rounds", [3])
async def test_both_brokers_of_a_pair_sigtermed_together_exit_cleanly(
    broker_factory: Callable[..., BrokerProcess], rounds: int
) -> None:
    for _ in range(rounds):  # the two exits race each other differently each time
        brokers = await _started_pair(broker_factory)
        for broker in brokers:
            assert broker.process is not None
            broker.process.send_signal(signal.SIGTERM)
        for broker in brokers:
            assert broker.process is not None
            try:
                status = broker.process.wait(timeout=EXIT_LIMIT_SECONDS)
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"still stopping (waiting out its grace period?): {broker.log()[-3000:]}"
                ) from None
            log = broker.log()
            assert status == 0, log[-3000:]
            errors = [line for line in log.splitlines() if " ERROR " in line or "Traceback" in line]
            assert not errors, log[-3000:]
