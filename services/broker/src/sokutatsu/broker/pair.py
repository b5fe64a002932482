"""The link between the two brokers of a pair.

Each broker streams to its peer (``BrokerControl.ReplicateWatermarks``) what the
subscribers it serves have acknowledged: every ``WATERMARK_INTERVAL_MS`` when
something changed, and a frame at least every :data:`KEEPALIVE_SECONDS` in any
case. The receiver trims its shadow copies with them, and the frames are also
how each broker knows its peer is up: no frame for ``PEER_TIMEOUT_MS`` and the
peer counts as down (publishes are acknowledged alone, with ``single_copy``;
the peer's subscribers are served here when they come). The first frame of a
stream, and the next one after a durable subscription is created, also list
the sender's durable subscriptions; the receiver creates those it lacks. The
first frame of each of the sender's peer sessions carries its holdings
(pair_state.py, invariant 4); frames after it may carry fills for subscribers the
peer, restarted, reclaims (invariant 7).

At start, a broker with a peer asks the peer's role: when the peer is already
active (it took over while this one was away), this one rejoins as standby
(a restarted broker starts as standby anyway: pair_state.py, invariant 2).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from grpc import aio

from sokutatsu.broker.broker import Broker
from sokutatsu.broker.pair_state import ACTIVE, STANDBY, check_role
from sokutatsu.broker.v1 import broker_pb2, broker_pb2_grpc
from sokutatsu.core.shutdown import stop_if_cancelled
from sokutatsu.core.tls import open_channel

log = logging.getLogger(__name__)

KEEPALIVE_SECONDS = 0.1
# What a peer from before creation tags is taken to have acknowledged of this broker's lists: all
# (invariant 8, subscription_lists.py).
ALL_ACKNOWLEDGED = 2**63
RETRY_SECONDS = (0.05, 0.5)
PROBE_TIMEOUT_SECONDS = 1.0
PEER_CHECK_SECONDS = 0.05
# How long a standby that does not hear its peer waits for the peer's answer at its client
# address before it serves a subscriber itself (Broker._claim).
CLAIM_PROBE_SECONDS = 0.3


async def join(broker: Broker) -> None:
    """Before serving: rejoin as standby when the peer is already active."""
    if not broker.peer:
        return
    info = await _peer_role(broker, PROBE_TIMEOUT_SECONDS)
    if info is None:
        return
    broker.pair.heard_by_probe()
    if info.role == ACTIVE:
        broker.pair.rejoin(info.broker_id, info.epoch)


async def _peer_role(broker: Broker, seconds: float) -> broker_pb2.RoleInfo | None:
    """The peer's answer to GetRole at its client address, or None."""
    try:
        async with open_channel(broker.peer, cluster=True) as channel:
            return await broker_pb2_grpc.BrokerControlStub(channel).GetRole(
                broker_pb2.GetRoleRequest(), timeout=seconds
            )
    except aio.AioRpcError as exc:
        log.info("peer %s did not answer GetRole (%s)", broker.peer, exc.code().name)
        return None


def install_probe(broker: Broker) -> None:
    """Let the broker ask its peer's role (before it serves a subscriber alone, or after it did not run)."""

    async def probe() -> broker_pb2.RoleInfo | None:
        return await _peer_role(broker, CLAIM_PROBE_SECONDS)

    broker.peer_role = probe


async def watch_peer(broker: Broker) -> None:
    """Run until cancelled: tell the listeners when the peer comes or goes, or when this broker
    starts or stops acknowledging alone otherwise (a monitored pair's lease or role, pair_state.py
    invariant 6): open publish streams then send a fresh acknowledgement saying so."""
    was_up = broker.peer_up
    was_alone = broker.pair.acks_alone()[0]
    while True:
        await asyncio.sleep(PEER_CHECK_SECONDS)
        await broker.confirm_role()
        up = broker.peer_up
        overdue = broker.reclaiming and broker.reclaim_overdue()
        if overdue:
            # Invariant 7: a restarted broker whose peer's fill did not come keeps what it holds as
            # shadows (a peer that is silent a moment meanwhile sends it on its next stream).
            broker.end_reclaims(overdue)
        alone = broker.pair.acks_alone()[0]
        if up != was_up:
            log.warning("peer %s is %s", broker.peer or "(unknown)", "back" if up else "not heard from")
        if up != was_up or alone != was_alone:
            was_up, was_alone = up, alone
            for listener in list(broker.peer_listeners):
                listener()


async def stream_watermarks(broker: Broker, own_address: Callable[[], str]) -> None:
    """Run until cancelled: keep a watermark stream open to the peer, reconnecting as needed."""
    interval = max(broker.settings.watermark_interval_ms / 1000, 0.001)
    delay = RETRY_SECONDS[0]
    while True:
        stop_if_cancelled()
        peer = broker.pair.link_address
        if not peer or not own_address():
            await asyncio.sleep(KEEPALIVE_SECONDS)
            continue
        opened = asyncio.get_running_loop().time()
        try:
            async with open_channel(peer, cluster=True) as channel:
                stub = broker_pb2_grpc.BrokerControlStub(channel)
                await stub.ReplicateWatermarks(_frames(broker, own_address(), interval, peer))
        except aio.AioRpcError as exc:
            log.debug("watermark stream to %s: %s", peer, exc.code().name)
        except Exception:
            log.exception("watermark stream to %s failed", peer)
        if broker.pair.link_address != peer or asyncio.get_running_loop().time() - opened > RETRY_SECONDS[1]:
            # A new peer, or a stream that ran a while (a peer that restarted): reconnect at once,
            # not after the backoff earlier failures built up (a restarted peer waits for this
            # stream to settle its claims: pair_state.py, invariant 7).
            delay = RETRY_SECONDS[0]
        if broker.pair.link_address != peer:
            continue
        await asyncio.sleep(delay)
        delay = min(delay * 2, RETRY_SECONDS[1])


async def _frames(
    broker: Broker, address: str, interval: float, peer: str
) -> AsyncGenerator[broker_pb2.DeliveredWatermarks, None]:
    loop = asyncio.get_running_loop()
    # A new stream starts with every position: the peer may have missed earlier frames.
    marks = broker.watermarks(everything=True)
    last_sent = 0.0
    subscriptions_sent: tuple[int, int] = (-1, -1)
    # The session whose holdings went out on this stream (-1: none yet; a new stream sends them), and
    # the holdings' version then (they go again when it changes: a restart claim settled, invariant 7).
    holdings_sent = -1
    holdings_version = broker.holdings_version
    # The fills sent on this stream (a new stream sends those still wanted again: invariant 7).
    fills_sent: set[tuple[str, str]] = set()
    while broker.pair.link_address == peer:
        await broker.confirm_role()
        now = loop.time()
        version = (broker.subscriptions_version, broker.lists_resend)
        session = broker.pair.session
        renewed = broker.holdings_version != holdings_version
        if (
            marks
            or now - last_sent >= KEEPALIVE_SECONDS
            or version != subscriptions_sent
            or session != holdings_sent
            or renewed
        ):
            # Holdings are taken here, after the session opened and only while this broker hears
            # its peer (pair_state.py, invariant 4): taken earlier they could miss what it still
            # acknowledges alone, and the peer would count itself synced on them.
            holdings = (session != holdings_sent or renewed) and broker.peer_up
            holdings_version = broker.holdings_version
            yield broker_pb2.DeliveredWatermarks(
                broker_id=broker.settings.instance,
                subscribers=marks,
                address=address,
                role=broker.role,
                epoch=broker.epoch,
                not_hearing_you=not broker.pair.peer_up,
                subscriptions=broker.durable_subscriptions() if version != subscriptions_sent else (),
                subscriptions_included=version != subscriptions_sent,
                expired=broker.expired_subscriptions() if version != subscriptions_sent else (),
                deleted=broker.deleted_subscriptions() if version != subscriptions_sent else (),
                creation_tags=True,
                # Only a standby of a pair without a monitor says it (pair_state.py, invariant 2).
                caught_up=not broker.pair.monitored and broker.role == STANDBY and broker.caught_up,
                subscriptions_version=broker.subscriptions_version if version != subscriptions_sent else 0,
                subscriptions_applied=broker.peer_version_applied,
                session=session,
                holdings_included=holdings,
                holdings=broker.holdings() if holdings else (),
            )
            last_sent = now
            subscriptions_sent = version
            holdings_sent = session
        if broker.fills_wanted:
            for chunk in broker.fill_frames(fills_sent):
                yield broker_pb2.DeliveredWatermarks(
                    broker_id=broker.settings.instance,
                    address=address,
                    role=broker.role,
                    epoch=broker.epoch,
                    not_hearing_you=not broker.pair.peer_up,
                    session=broker.pair.session,
                    fills=[chunk],
                    creation_tags=True,
                )
        await asyncio.sleep(interval)
        marks = broker.watermarks()


async def apply_frame(broker: Broker, frame: broker_pb2.DeliveredWatermarks) -> None:
    """One frame of the peer's stream, in the stream's order."""
    check_role(frame.role, "DeliveredWatermarks.role")
    broker.apply_watermarks(frame)
    if frame.subscriptions_included:
        broker.note_peer_tags(frame.creation_tags)
    if frame.expired:
        await broker.apply_removed(frame.expired, expired=True)
    if frame.deleted:
        await broker.apply_removed(frame.deleted, expired=False)
    if frame.subscriptions_included or frame.subscriptions:
        # The queues this creates take the peer's holdings as they are made (Broker._add_queue).
        # A peer from before the tags acknowledges nothing: its whole lists count as built after
        # everything, the old rule (invariant 8).
        applied = frame.subscriptions_applied if frame.creation_tags else ALL_ACKNOWLEDGED
        await broker.adopt_subscriptions(frame.subscriptions, whole=frame.subscriptions_included, applied=applied)
        # Acknowledged in this broker's next frames (invariant 8); a restarted peer's versions start
        # above its old ones.
        broker.peer_version_applied = frame.subscriptions_version
    broker.lead_both_standby(frame)  # last: with the subscriptions the frame brought (invariant 2)


async def receive_watermarks(
    broker: Broker, frames: AsyncIterator[broker_pb2.DeliveredWatermarks], stopping: asyncio.Event
) -> None:
    """Apply the peer's frames until its stream ends or this broker begins to stop.

    Ending at ``stopping`` (before the server's grace period) matters when both brokers stop
    together: each would otherwise hold its server open for the other's stream for the whole
    grace period, then log the stream's cancellation as an error."""

    async def apply() -> None:
        # A new stream: what the peer's earlier streams carried acknowledges nothing of this one's
        # (the peer may have restarted, its clock set back: invariant 8).
        broker.peer_version_applied = 0
        async for frame in frames:
            await apply_frame(broker, frame)

    if stopping.is_set():
        return
    applying = asyncio.ensure_future(apply())
    stopped = asyncio.ensure_future(stopping.wait())
    try:
        done, _ = await asyncio.wait({applying, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if applying in done:
            applying.result()  # the stream's own error, if it failed
    finally:
        for task in (applying, stopped):
            task.cancel()
        await asyncio.gather(applying, stopped, return_exceptions=True)
