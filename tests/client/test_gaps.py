"""The SDK's gap reports from what the broker's messages say (no server needed: ``_accept`` is the
receiving path's pure part)."""

from __future__ import annotations

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.client import Subscriber


def _message(seq: int, previous: int, gap: tuple[int, int] | None = None) -> broker_pb2.Message:
    message = broker_pb2.Message(publisher_id="p", publisher_seq=seq, previous_seq=previous, key="k")
    if gap is not None:
        message.retention_gap.CopyFrom(broker_pb2.RetentionGap(first_seq=gap[0], last_seq=gap[1], over_bytes=20))
    return message


def test_a_plain_gap_before_a_retention_range_is_reported_too() -> None:
    """Review of #20: a message telling of discards 61..80 after delivery 10 hid the loss of 11..60
    (lost for another reason: a broker restarted without them); both are reported now."""
    subscriber = Subscriber("127.0.0.1:1", "s", "t", on_gap="report")
    subscriber._accept([_message(10, 9)])
    subscriber._accept([_message(81, 80, gap=(61, 80))])
    assert [(g.first_missing, g.last_missing, g.reason) for g in subscriber.gaps] == [
        (11, 60, ""),
        (61, 80, "retention bytes"),
    ]


def test_a_retention_range_right_after_the_last_delivery_is_one_gap() -> None:
    subscriber = Subscriber("127.0.0.1:1", "s", "t", on_gap="report")
    subscriber._accept([_message(10, 9)])
    subscriber._accept([_message(31, 30, gap=(11, 30))])
    assert [(g.first_missing, g.last_missing, g.reason) for g in subscriber.gaps] == [(11, 30, "retention bytes")]
