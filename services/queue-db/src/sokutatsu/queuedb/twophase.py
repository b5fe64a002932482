"""The two-phase commit baseline (``SOKUTATSU_TRANSFER_MODE=2pc``), the sender's side, and the gids
both sides name prepared batches by.

Per batch: prepare here (the messages deleted from the outbox, a decision row written), prepare there
(``PrepareBatch``), ``COMMIT PREPARED`` here (the decision), ``COMMIT PREPARED`` there
(``FinishPrepared``). Recovery is presumed abort: a batch whose decision row is committed is
committed on the receiver, any other prepared batch is rolled back on both. Prepared transaction
names are unique per PostgreSQL cluster, and two nodes may share one: the sender's own carries
``LOCAL_SUFFIX``.
"""

from __future__ import annotations

import contextlib
import time

import psycopg
from opentelemetry import trace

from sokutatsu.core.errors import InvalidArgument, echo
from sokutatsu.queuedb import store
from sokutatsu.queuedb.sender import RPC_TIMEOUT, Link, batch, log, tracer
from sokutatsu.queuedb.store import transfer
from sokutatsu.queuedb.v1 import queuedb_pb2, queuedb_pb2_grpc

GID_PREFIX = "sokutatsu:"
# The sender's own prepared transaction is named after the batch's gid plus this.
LOCAL_SUFFIX = "/sender"


def gid_prefix(sender: str) -> str:
    """Every gid of ``sender``'s prepared batches starts with this."""
    return f"{GID_PREFIX}{sender}:"


def check_gid(gid: str, sender: str) -> str:
    if not gid.startswith(gid_prefix(sender) if sender else GID_PREFIX) or len(gid) > 200:
        raise InvalidArgument(
            f"gid {echo(gid)} is not a Sokutatsu transfer gid ({echo(gid_prefix(sender or 'sender'))}…)"
        )
    return gid


class TwoPhase(Link):
    """The 2PC baseline's sessions towards one receiving node."""

    @property
    def _gids(self) -> str:
        return f"{gid_prefix(self.settings.node)}{self.peer.node}:"

    async def recover(self, conn: store.Conn, stub: queuedb_pb2_grpc.TransferAsyncStub) -> None:
        with self.recover_span() as span:
            aborted, finished = await self._recover_prepared(conn, stub)
            span.set_attribute("sokutatsu.transfer.aborted", aborted)
            span.set_attribute("sokutatsu.transfer.finished", finished)

    async def send(self, conn: store.Conn, stub: queuedb_pb2_grpc.TransferAsyncStub) -> None:
        while True:
            prepared = await self._prepare_local(conn)
            if prepared is None:
                await self.wait_for_work(conn)
                continue
            gid, sent = prepared
            with tracer.start_as_current_span(
                f"transfer {self.peer.node}",
                kind=trace.SpanKind.PRODUCER,
                attributes={
                    **self.link_attributes,
                    "sokutatsu.transfer.gid": gid,
                    "messaging.batch.message_count": len(sent.messages),
                },
            ):
                await self._commit_both(conn, stub, gid, sent)

    async def _commit_both(
        self,
        conn: store.Conn,
        stub: queuedb_pb2_grpc.TransferAsyncStub,
        gid: str,
        sent: queuedb_pb2.TransferBatch,
    ) -> None:
        """One batch prepared here: prepare there, commit here (the decision), commit there."""
        self.crash.reach("sender:prepared")
        await stub.PrepareBatch(queuedb_pb2.PrepareBatchRequest(batch=sent, gid=gid), timeout=RPC_TIMEOUT)
        self.crash.reach("sender:both-prepared")
        await transfer.finish(conn, gid + LOCAL_SUFFIX, commit=True)
        self.crash.reach("sender:committed")
        finished = await stub.FinishPrepared(
            queuedb_pb2.FinishPreparedRequest(gid=gid, commit=True), timeout=RPC_TIMEOUT
        )
        if not finished.found:
            # Prepared there a moment ago and committed here: only a hand-made ROLLBACK PREPARED gets here.
            log.error(
                "2pc transfer to %s: batch %s was prepared there but is gone; its messages are lost",
                self.peer.node,
                gid,
            )
        self.crash.reach("sender:finished")
        async with conn.transaction():
            # Not durable: a decision row left behind after a crash is only removed by the next recovery.
            await store.commit_lazily(conn)
            await transfer.drop_decision(conn, gid)

    async def _prepare_local(self, conn: store.Conn) -> tuple[str, queuedb_pb2.TransferBatch] | None:
        await conn.execute("BEGIN")
        try:
            rows = await self.pick(conn)
            if not rows:
                await conn.execute("ROLLBACK")
                return None
            gid = f"{self._gids}{rows[0][0]}-{time.time_ns()}"
            await transfer.take_outbox(conn, [r[0] for r in rows])
            await transfer.decide(conn, gid, self.peer.node)
            await transfer.prepare(conn, gid + LOCAL_SUFFIX)
        except BaseException:
            with contextlib.suppress(psycopg.Error):
                await conn.execute("ROLLBACK")
            raise
        return gid, batch(self.settings.node, [(*r[:7], r[0], r[8]) for r in rows])

    async def _recover_prepared(self, conn: store.Conn, stub: queuedb_pb2_grpc.TransferAsyncStub) -> tuple[int, int]:
        """Presumed abort; (batches aborted here, batches finished there)."""
        listed = await stub.ListPrepared(
            queuedb_pb2.ListPreparedRequest(sender_node=self.settings.node), timeout=RPC_TIMEOUT
        )
        remote = [g for g in listed.gids if g.startswith(self._gids)]
        local = {gid.removesuffix(LOCAL_SUFFIX) for gid in await transfer.prepared(conn, self._gids)}
        decided = await transfer.decided(conn, self.peer.node)
        for gid in local:  # prepared here, never decided: abort (its rows go back to the outbox)
            await transfer.finish(conn, gid + LOCAL_SUFFIX, commit=False)
        for gid in remote:
            commit = gid in decided
            await stub.FinishPrepared(queuedb_pb2.FinishPreparedRequest(gid=gid, commit=commit), timeout=RPC_TIMEOUT)
        await transfer.drop_decisions(conn, self.peer.node)
        log.info(
            "2pc transfer to %s: recovery aborted %d batches prepared here, finished %d prepared there",
            self.peer.node,
            len(local),
            len(remote),
        )
        return len(local), len(remote)
