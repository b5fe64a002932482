"""Hypothesis drives one subscriber queue through its ownership transitions (serve, leave, hand
over with or without a tail, shadow), publishes, acknowledgements at either broker and the
peer's holdings, and checks what ``caught_up`` rests on (subscription_queue.py): whatever this
copy received and its subscriber has not acknowledged, it still holds, or records in ``lacks``
(and its floor) as what it may lack."""

from __future__ import annotations

import tempfile
from collections import defaultdict
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sokutatsu.broker.disk_worker import DiskWorker
from sokutatsu.broker.messages import StoredMessage
from sokutatsu.broker.subscription import SubscriptionSpec
from sokutatsu.broker.subscription_queue import AWAY, LEAVING, SERVING, SHADOW, SubscriptionQueue
from sokutatsu.broker.v1 import broker_pb2

PUBLISHERS = st.sampled_from(["p1", "p2"])
AWAY_TAIL = 600  # bytes: a few messages, so an away copy trims often


class QueueOwnership(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        spec = SubscriptionSpec(
            subscriber_id="desk",
            topic="prices",
            exact_keys=frozenset(),
            prefixes=(),
            durable=True,
            mode="migrate",
            budget=1 << 40,  # never spills: this checks ownership, not the disk
        )
        self.queue = SubscriptionQueue(
            spec=spec,
            folder=Path(tempfile.mkdtemp(prefix="queue-ownership-")),
            disk=DiskWorker(),
            batch_messages=100,
            batch_bytes=1 << 20,
            linger_seconds=0.0,
            away_tail=AWAY_TAIL,
        )
        self.next_seq: dict[str, int] = defaultdict(int)
        # Every number this copy was given, per publisher.
        self.enqueued: dict[str, list[int]] = defaultdict(list)

    def _acked(self, publisher: str) -> int:
        return self.queue.acked.get(publisher, 0)

    @rule(publisher=PUBLISHERS, size=st.integers(50, 400))
    def publish(self, publisher: str, size: int) -> None:
        self.next_seq[publisher] += 1
        seq = self.next_seq[publisher]
        payload = broker_pb2.Message(publisher_id=publisher, publisher_seq=seq, body=bytes(size)).SerializeToString()
        message = StoredMessage(publisher, seq, payload, True)
        message.hold(1)
        self.queue.enqueue(message)
        self.enqueued[publisher].append(seq)

    @precondition(lambda self: self.queue.state in (SHADOW, AWAY))
    @rule(publisher=PUBLISHERS, back=st.integers(0, 5))
    def the_peer_says_acknowledged(self, publisher: str, back: int) -> None:
        """A watermark from the broker that serves the subscriber."""
        self.queue.trim({publisher: max(self.next_seq[publisher] - back, 0)})

    @precondition(lambda self: self.queue.state in (SERVING, LEAVING))
    @rule(publisher=PUBLISHERS, back=st.integers(0, 5))
    def the_subscriber_acknowledges_here(self, publisher: str, back: int) -> None:
        self.queue.ack({publisher: max(self.next_seq[publisher] - back, 0)})

    @rule(publisher=PUBLISHERS, ahead=st.integers(0, 5))
    def the_peers_holdings(self, publisher: str, ahead: int) -> None:
        """The peer put more of this publisher in its copy than this one has (it was away)."""
        self.queue.may_lack(publisher, self.next_seq[publisher] + ahead)

    @rule()
    def serve(self) -> None:
        self.queue.serve()

    @precondition(lambda self: self.queue.state in (SERVING, LEAVING))
    @rule()
    def redirect(self) -> None:
        self.queue.leave(broker_pb2.Redirect(target="127.0.0.1:7202"))

    @precondition(lambda self: self.queue.state in (SERVING, LEAVING))
    @rule(active=st.booleans())
    def release(self, active: bool) -> None:
        """Switchover step 4: the active keeps a tail (away), the standby a shadow."""
        self.queue.hand_over(keep_tail=active)

    @rule()
    def demoted(self) -> None:
        self.queue.shadow("127.0.0.1:7202")

    @invariant()
    def what_it_may_lack_is_recorded(self) -> None:
        queue = self.queue
        held: dict[str, set[int]] = defaultdict(set)
        for source in (queue.memory, queue.front, queue.readback, queue.in_flight, queue.spill_buffer):
            for item in source:
                held[item.publisher_id].add(item.seq)
        for publisher, seqs in self.enqueued.items():
            acked = self._acked(publisher)
            lacks = queue.lacks.get(publisher, 0)
            for seq in seqs:
                if seq > acked and seq not in held[publisher]:
                    assert seq <= lacks, f"{publisher} {seq} dropped unacknowledged and not recorded as lacking"

    @invariant()
    def behind_says_whether_it_lacks_anything_unacknowledged(self) -> None:
        queue = self.queue
        expected = any(seq > self._acked(p) for p, seq in queue.lacks.items())
        assert queue.behind == expected

    @invariant()
    def the_floor_covers_what_it_lacks(self) -> None:
        for publisher, seq in self.queue.lacks.items():
            assert self.queue.floor.get(publisher, 0) >= seq

    @invariant()
    def an_away_copy_keeps_only_its_tail(self) -> None:
        if self.queue.state == AWAY:
            assert self.queue.memory_bytes <= AWAY_TAIL


TestQueueOwnership = QueueOwnership.TestCase
TestQueueOwnership.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
