"""The recovery table (seed 004 §3.3.3-3.3.4): the receiver's row ``transfer_in(sender,
last_received_id)`` per sending node, and the sender's recovery from it.

**Receiver.** ``Deliver`` stores a batch and moves the recovery row ``(sender, last_received_id)``
in one local transaction, commits, and only then answers. So the row always says exactly what
this node holds from the sender: a sender that lost the answer asks ``GetRecoveryState`` on
reconnect and resends only what is above it (seed §3.3.4). A batch, or part of one, at or below
the row is a replay: ignored and counted. A batch that starts above the row plus one would leave
a hole: refused with FAILED_PRECONDITION. The receiver answers with its ``last_received_id`` and
``durable_id`` (the two differ when it stored sender-durable messages without the flush, seed
001: see docs/queue-db.md); ``GetRecoveryState`` flushes before it answers.

**Sender** (step 0 of :mod:`.onephase`), on every (re)connection: ask the receiver's
``last_received_id``; sending messages at or below it are marked sent without resending (seed
case 2-2), the rest are resent (case 2-1). If the receiver holds more than this node ever
assigned (this node lost the end of its log), the cursor moves up so no id is used twice.
"""

from __future__ import annotations

from collections.abc import Sequence

from sokutatsu.core.errors import FailedPrecondition, echo
from sokutatsu.queuedb import store
from sokutatsu.queuedb.db import Database
from sokutatsu.queuedb.sender import RPC_TIMEOUT, Link, log
from sokutatsu.queuedb.store import transfer
from sokutatsu.queuedb.v1 import queuedb_pb2, queuedb_pb2_grpc


class RecoveryTable:
    """This node's recovery rows as a receiver, and how far each sender's batches are known flushed."""

    def __init__(self) -> None:
        # Per sender, the highest transfer id stored by a flushed commit (or flushed since).
        # Unknown after a restart: 0 until the next flushed commit, which covers everything before it.
        self._durable: dict[str, int] = {}

    async def receive(
        self, conn: store.Conn, sender: str, messages: Sequence[queuedb_pb2.TransferredMessage]
    ) -> tuple[int, int]:
        """In the batch's transaction: store the messages above the sender's row and move the row to
        the last; (the row now, how many were stored). A gap is FAILED_PRECONDITION."""
        last = await transfer.recovery_row(conn, sender)
        new = [m for m in messages if m.transfer_id > last]
        if new and new[0].transfer_id != last + 1:
            raise FailedPrecondition(
                f"this node holds transfer ids from {echo(sender)} up to {last}; a batch starting at "
                f"{new[0].transfer_id} would leave a gap (ask GetRecoveryState and resend from {last + 1})"
            )
        if new:
            await transfer.store_batch(conn, new)
            last = new[-1].transfer_id
            await transfer.move_recovery_row(conn, sender, last)
        return last, len(new)

    def committed(self, sender: str, last: int, *, flushed: bool) -> int:
        """The batch's transaction committed, up to ``last`` (``flushed``: with the flush); the
        sender's ``durable_id``, the highest id known flushed."""
        if flushed:
            self._durable[sender] = max(self._durable.get(sender, 0), last)
        return self._durable.get(sender, 0)

    async def flushed(self, db: Database, sender: str) -> int:
        """The sender's ``last_received_id``, everything at or below it on disk before the answer (a write
        committed with the flush: every commit before it is flushed too, sender-durable batches
        stored without the flush included)."""
        async with db.transaction() as conn:
            last = await transfer.touch_recovery_row(conn, sender)
        self.committed(sender, last, flushed=True)
        return last


async def recover(link: Link, conn: store.Conn, stub: queuedb_pb2_grpc.TransferAsyncStub) -> tuple[int, int, int]:
    """Seed 004 §3.3.4; (the receiver's last id, messages marked sent, the last id assigned here)."""
    node = link.peer.node
    received = await last_received(link, stub)
    async with conn.transaction():
        last_sent = await transfer.cursor(conn, node)
        done = await transfer.forget_sent(conn, node, received)
        if received > last_sent:
            log.warning(
                "transfer to %s: the receiver holds up to id %d but this node assigned only up to %d "
                "(its log lost the end); continuing after %d",
                node,
                received,
                last_sent,
                received,
            )
            await transfer.move_cursor(conn, node, received)
    log.info(
        "transfer to %s: receiver holds up to id %d; %d sending messages it has were marked sent",
        node,
        received,
        done,
    )
    return received, done, last_sent


async def last_received(link: Link, stub: queuedb_pb2_grpc.TransferAsyncStub) -> int:
    """The receiver's ``last_received_id`` for this node, flushed there before the answer."""
    state = await stub.GetRecoveryState(
        queuedb_pb2.GetRecoveryStateRequest(sender_node=link.settings.node), timeout=RPC_TIMEOUT
    )
    return state.last_received_id
