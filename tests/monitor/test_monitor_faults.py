"""The monitor under faults of the pair, as real processes: hostile epochs, a flooded active.

Issue 19, items 4 and 5.

Each test starts a real broker pair and a real monitor, makes the fault with the generated
stubs or a signal, and waits for what the monitor says (its log or its status); nothing
asserts on durations (the bounds in ``until`` only stop a hung test).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator

import grpc
import pytest
from grpc import aio

from sokutatsu.broker.v1 import broker_pb2, broker_pb2_grpc
from sokutatsu.cli.chaos_proxy import LinkProxy
from sokutatsu.client import Publisher, Subscriber
from sokutatsu.core.tls import open_channel
from sokutatsu.monitor.pair import MAX_EPOCH
from sokutatsu.monitor.v1 import monitor_pb2
from tests.broker.fix_broker import BrokerProcess, until
from tests.monitor.fix_monitor import UNTIL_LIMIT_SECONDS, MonitorProcess
from tests.monitor.tcp_proxy import TcpProxy

pytestmark = pytest.mark.timeout(180)

Pair = tuple[BrokerProcess, BrokerProcess]
STANDBY = broker_pb2.BROKER_ROLE_STANDBY
ACTIVE = broker_pb2.BROKER_ROLE_ACTIVE


def _pair_seen(status: monitor_pb2.MonitorStatus) -> bool:
    roles = {b.broker_id: (b.serving, b.role) for b in status.brokers}
    return roles == {"broker-a": (True, ACTIVE), "broker-b": (True, STANDBY)}


def _broker(status: monitor_pb2.MonitorStatus, broker_id: str) -> monitor_pb2.BrokerState:
    return next(b for b in status.brokers if b.broker_id == broker_id)


def _failovers(status: monitor_pb2.MonitorStatus) -> list[monitor_pb2.Switchover]:
    return [r for r in status.recent_switchovers if r.reason == monitor_pb2.SWITCHOVER_REASON_FAILOVER]


@contextlib.contextmanager
def _paused(broker: BrokerProcess) -> Iterator[None]:
    """SIGSTOP the broker for the block (SIGCONT whatever happens, so it can be stopped)."""
    assert broker.process is not None
    broker.process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        broker.process.send_signal(signal.SIGCONT)


async def _until_logged(monitor: MonitorProcess, text: str) -> str:
    """Wait until the monitor's log says ``text``; fail at once if the monitor exited."""
    assert monitor.process is not None
    deadline = time.monotonic() + UNTIL_LIMIT_SECONDS
    while time.monotonic() < deadline:
        log = monitor.log()
        if text in log:
            return log
        if monitor.process.poll() is not None:
            raise AssertionError(f"the monitor exited ({monitor.process.returncode}):\n{log}")
        await asyncio.sleep(0.02)
    raise AssertionError(f"the monitor did not log {text!r}:\n{monitor.log()}")


async def _set_role(address: str, role: broker_pb2.BrokerRole.ValueType, epoch: int) -> None:
    async with open_channel(address, cluster=True) as channel:
        await broker_pb2_grpc.BrokerControlStub(channel).SetRole(
            broker_pb2.SetRoleRequest(role=role, epoch=epoch), timeout=10
        )


async def _highest_epoch_accepted(address: str) -> int:
    """Put the standby at the highest epoch it accepts: 2^64-1 (what issue 19 did), or the most a
    broker that refuses absurd epochs takes (the monitor's ceiling: nothing above is proposed)."""
    try:
        await _set_role(address, STANDBY, 2**64 - 1)
    except aio.AioRpcError as error:
        if error.code() != grpc.StatusCode.INVALID_ARGUMENT:
            raise
        await _set_role(address, STANDBY, MAX_EPOCH)
        return MAX_EPOCH
    return 2**64 - 1


async def test_an_exhausted_epoch_is_logged_and_the_monitor_keeps_running(
    broker_pair: Callable[..., Pair], monitor_factory: Callable[..., MonitorProcess]
) -> None:
    """Issue 19 item 5: anyone sets the standby's epoch to 2^64-1, then the active pauses.

    The failover would need an epoch above it, which uint64 cannot hold: the monitor raised
    ValueError in a task of its task group and exited. It must say the pair's epoch is
    exhausted, propose nothing, and keep watching (and answer once the active is back).
    """
    a, b = broker_pair()
    monitor = monitor_factory((a, b))
    monitor.start()
    await monitor.until(_pair_seen, "the pair")
    epoch = await _highest_epoch_accepted(b.address)
    await monitor.until(lambda s: _broker(s, "broker-b").epoch == epoch, f"broker-b at epoch {epoch}")

    with _paused(a):
        log = await _until_logged(monitor, "epoch is exhausted")
        said = next(line for line in log.splitlines() if "epoch is exhausted" in line)
        assert "broker-b" in said, said
        assert str(epoch) in said, said
        status = await monitor.until(lambda s: not _broker(s, "broker-a").serving, "broker-a unreachable")
        assert monitor.process is not None
        assert monitor.process.poll() is None
        assert _failovers(await monitor.status(recent=100)) == []
        assert _broker(status, "broker-b").role == STANDBY

    await monitor.until(_pair_seen, "the pair again after broker-a resumed")
    assert monitor.process.poll() is None
    log = monitor.log()
    assert "Traceback" not in log, log
    assert "Value out of range" not in log, log
    assert monitor.stop() == 0


# Issue 19 item 4: one client opens this many Subscribe streams on the active; the broker's
# per-client limit (MAX_STREAMS_PER_CLIENT, 1000 by default) refuses the rest.
FLOOD_STREAMS = 1500
STREAM_LIMIT = 1000


@contextlib.asynccontextmanager
async def _flood(address: str, count: int) -> AsyncIterator[tuple[int, int]]:
    """``count`` Subscribe streams on one channel (as ``sokutatsu chaos`` floods); yields
    (accepted, refused) once each has its answer, and holds them open until the block ends."""
    async with open_channel(address, cluster=True) as channel:
        stub = broker_pb2_grpc.BrokerStub(channel)
        calls = []

        async def one(i: int) -> bool:
            call = stub.Subscribe()
            calls.append(call)
            subscription = broker_pb2.Subscription(subscriber_id=f"flood-{i}", topic="flood")
            try:
                await call.write(
                    broker_pb2.SubscribeRequest(open=broker_pb2.SubscribeOpen(subscription=subscription, credits=1))
                )
                reply = await call.read()
            except (aio.AioRpcError, aio.UsageError):
                return False
            return isinstance(reply, broker_pb2.SubscribeResponse) and reply.WhichOneof("frame") == "subscribed"

        answers = await asyncio.gather(*(one(i) for i in range(count)))
        try:
            yield sum(answers), count - sum(answers)
        finally:
            for call in calls:
                call.cancel()


async def _broker_stats(address: str) -> broker_pb2.BrokerStats:
    async with open_channel(address, cluster=True) as channel:
        stats: broker_pb2.BrokerStats = await broker_pb2_grpc.BrokerAdminStub(channel).GetStats(
            broker_pb2.GetStatsRequest(), timeout=10
        )
        return stats


async def test_a_flooded_active_the_monitor_cannot_hear_is_not_failed_over(
    broker_pair: Callable[..., Pair], monitor_factory: Callable[..., MonitorProcess]
) -> None:
    """Issue 19 item 4: 1,500 Subscribe streams from one client on the active, and the monitor
    stops hearing the active meanwhile (its statistics late: here held at a proxy, so it happens
    every run). The standby still hears the active through the pair link, so the active is busy,
    not dead: the monitor holds the failover (it promoted broker-b at epoch 1 before) and the
    pair keeps its roles. Once the monitor hears broker-a again, nothing has moved."""
    # The test's premise is that broker-b keeps hearing broker-a through the flood: a peer timeout
    # that four test workers on two cores cannot starve past (with 1 s, broker-b sometimes stopped
    # hearing it, and the monitor then rightly promoted broker-b, which holds everything).
    a, b = broker_pair(peer_timeout_ms="5000")
    proxy = TcpProxy(a.address)
    await proxy.start()
    monitor = monitor_factory(brokers=f"broker-a={proxy.address},broker-b={b.address}")
    monitor.start()
    try:
        await monitor.until(_pair_seen, "the pair")
        proxy.hold()
        async with _flood(a.address, FLOOD_STREAMS) as (accepted, refused):
            assert (accepted, refused) == (STREAM_LIMIT, FLOOD_STREAMS - STREAM_LIMIT)
            log = await _until_logged(monitor, "role change held")
            said = next(line for line in log.splitlines() if "role change held" in line)
            assert "broker-b still hears it" in said, said
            await monitor.until(lambda s: not _broker(s, "broker-a").serving, "broker-a unreachable to the monitor")
            standby, active = await _broker_stats(b.address), await _broker_stats(a.address)
            assert (standby.role, active.role) == (STANDBY, ACTIVE)
            assert active.subscriber_streams == STREAM_LIMIT
            # Most of the rest reach the limit; grpc may end some on the client before they do.
            assert active.client_limits.stream_refusals > 0
            assert _failovers(await monitor.status(recent=100)) == []
        proxy.release()
        status = await monitor.until(_pair_seen, "the pair again once the monitor hears broker-a")
        assert status.active_broker_id == "broker-a"
        assert _failovers(await monitor.status(recent=100)) == []
        assert (await _broker_stats(b.address)).epoch == 0
    finally:
        proxy.release()
        await proxy.close()
    assert monitor.process is not None
    assert monitor.process.poll() is None
    assert "Traceback" not in monitor.log()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def _roles(addresses: dict[str, str]) -> dict[str, int]:
    """Each broker's answer to GetRole (0 when it does not answer within a second)."""
    out: dict[str, int] = {}
    for broker_id, address in addresses.items():
        try:
            async with open_channel(address, cluster=True) as channel:
                info = await broker_pb2_grpc.BrokerControlStub(channel).GetRole(broker_pb2.GetRoleRequest(), timeout=1)
            out[broker_id] = info.role
        except aio.AioRpcError:
            out[broker_id] = 0
    return out


async def _both_active_until_promoted(addresses: dict[str, str], monitor: MonitorProcess) -> int:
    """Poll both brokers' roles until the monitor promoted broker-b, and 2 s more; return how many
    polls found both ACTIVE."""
    both_active = 0
    promoted_at = 0.0
    give_up = time.monotonic() + UNTIL_LIMIT_SECONDS
    while not promoted_at or time.monotonic() - promoted_at < 2.0:
        assert time.monotonic() < give_up, f"the monitor did not promote broker-b:\n{monitor.log()}"
        roles = await _roles(addresses)
        if roles["broker-b"] == ACTIVE and not promoted_at:
            promoted_at = time.monotonic()
        both_active += roles == {"broker-a": ACTIVE, "broker-b": ACTIVE}
        await asyncio.sleep(0.02)
    return both_active


async def test_an_active_cut_off_from_its_peer_and_the_monitor_never_acknowledges_beside_the_promoted_standby(
    broker_factory: Callable[..., BrokerProcess], monitor_factory: Callable[..., MonitorProcess]
) -> None:
    """Found by `sokutatsu chaos` (seed 508077, docs/chaos.md): broker-a active, the pair's link cut
    both ways, and the monitor unable to reach broker-a (there a CPU flood; here a proxy that holds
    its traffic) while broker-a runs on. The monitor promoted broker-b; broker-a kept its role and,
    not hearing its peer, acknowledged publishes alone: both answered ACTIVE, and what broker-a
    acknowledged alone was never on broker-b, which serves the subscriber from then on.

    Schedule: a publisher reaches broker-a directly and broker-b through a proxy; once broker-a
    holds the monitor's lease, a durable subscriber reads 1..200 and disconnects; the monitor's
    path to broker-a is held, then the pair's link and the publisher's path to broker-b are cut;
    201..300 are published; the test watches both brokers' roles until the monitor has promoted
    broker-b and a while after; the publisher stops, everything heals, and the subscriber reads
    from the active what is there.
    Before the fix both answered ACTIVE and 201..300, acknowledged by broker-a alone, never reached
    the subscriber. Now broker-a acknowledges alone only under the monitor's lease, taken while it
    already did not hear its peer (it never got one: the monitor could not hear it), steps down once
    its lease lapsed, and the monitor promotes broker-b only after that lease lapsed on its clock.
    """
    a_port, b_port = _free_port(), _free_port()
    a_address, b_address = f"127.0.0.1:{a_port}", f"127.0.0.1:{b_port}"
    to_a, to_b, publisher_to_b = LinkProxy(a_address), LinkProxy(b_address), LinkProxy(b_address)
    for proxy in (to_a, to_b, publisher_to_b):
        await proxy.start()
    common = {"peer_timeout_ms": "500", "monitored": "true"}
    a = broker_factory(instance="broker-a", role="active", listen=a_address, peer_link=to_b.address, **common)
    a.start()
    b = broker_factory(
        instance="broker-b", role="standby", listen=b_address, peer=a_address, peer_link=to_a.address, **common
    )
    b.start()
    monitor_path = TcpProxy(a_address)
    await monitor_path.start()
    # The monitor's own calls to broker-a go through the proxy; it knows broker-a's address.
    monitor = monitor_factory(
        brokers=f"broker-a={a_address},broker-b={b_address}", broker_links=f"broker-a={monitor_path.address}"
    )
    monitor.start()
    addresses = {"broker-a": a_address, "broker-b": b_address}
    subscription = {"topic": "prices", "durable": True, "mode": "migrate"}
    try:
        await monitor.until(_pair_seen, "the pair")

        async def caught_up() -> bool:
            both = [await _broker_stats(a_address), await _broker_stats(b_address)]
            return all(s.peer_up and s.caught_up for s in both)

        await until(caught_up, "the brokers to hear each other")

        async def leased() -> bool:
            async with open_channel(a_address, cluster=True) as channel:
                reply = await broker_pb2_grpc.BrokerControlStub(channel).RenewLease(
                    broker_pb2.RenewLeaseRequest(), timeout=10
                )
            return reply.remaining_ms > 0

        await until(leased, "broker-a to hold the monitor's lease")
        desk = Subscriber([a_address, b_address], "desk", **subscription)  # type: ignore[arg-type]
        await desk.start()
        got: list[tuple[str, int]] = []
        # Closed without waiting for what is not acknowledged: only what was acknowledged must arrive.
        pub = Publisher([a_address, publisher_to_b.address], "feed", ack_timeout=120)
        await pub.start()
        try:
            for i in range(1, 201):
                pub.publish_nowait("prices", f"K{i % 20:02d}", f"feed:{i}".encode())
            await pub.flush()
            async for message in desk:
                got.append((message.publisher_id, message.publisher_seq))
                if len(got) == 200:
                    break
            await desk.close()

            monitor_path.hold()
            for proxy in (to_a, to_b, publisher_to_b):
                proxy.cut()
            for i in range(201, 301):
                pub.publish_nowait("prices", f"K{i % 20:02d}", f"feed:{i}".encode())
            both_active = await _both_active_until_promoted(addresses, monitor)
            acknowledged = pub.acked_seq
        finally:
            await pub.close()
        for proxy in (to_a, to_b, publisher_to_b):
            proxy.heal()
        monitor_path.release()

        async def settled() -> bool:
            roles = await _roles(addresses)
            both = [await _broker_stats(a_address), await _broker_stats(b_address)]
            return roles == {"broker-a": STANDBY, "broker-b": ACTIVE} and all(s.peer_up for s in both)

        await until(settled, "broker-b active, broker-a standby, hearing each other")
        # A marker published after the heal: once the subscriber has it, it has everything before.
        async with Publisher([a_address, b_address], "marker") as marker:
            await marker.publish("prices", "END", b"marker:1")
        desk = Subscriber([a_address, b_address], "desk", **subscription)  # type: ignore[arg-type]
        await desk.start()
        async for message in desk:
            if message.publisher_id == "marker":
                break
            got.append((message.publisher_id, message.publisher_seq))
        gaps = list(desk.gaps)
        await desk.close()
    finally:
        monitor_path.release()
        await monitor_path.close()
        for proxy in (to_a, to_b, publisher_to_b):
            await proxy.stop()
    delivered = {seq for publisher, seq in got if publisher == "feed"}
    lost = sorted(set(range(1, acknowledged + 1)) - delivered)
    assert not lost, f"{len(lost)} acknowledged messages never delivered ({lost[0]}..{lost[-1]}); gaps {gaps}"
    assert not gaps
    assert both_active == 0, f"both brokers answered ACTIVE in {both_active} polls"
    assert "its lease from the monitor lapsed" in a.log()
