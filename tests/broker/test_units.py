"""Pure pieces of the broker, checked against simple models."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sokutatsu.broker.service import _merge
from sokutatsu.broker.subscription import SubscriptionSpec
from sokutatsu.broker.v1 import broker_pb2

keys = st.text(alphabet="AB12.", min_size=1, max_size=5)


@given(exact=st.frozensets(keys, max_size=4), prefixes=st.lists(keys, max_size=3), key=keys)
def test_filter_matches_exact_keys_or_prefixes(exact: frozenset[str], prefixes: list[str], key: str) -> None:
    spec = SubscriptionSpec("s", "t", exact, tuple(prefixes), durable=False, mode="flow-to-disk", budget=1)
    unfiltered = not exact and not prefixes
    expected = unfiltered or key in exact or any(key.startswith(p) for p in prefixes)
    assert spec.matches(key) == expected


def _ack(through: int, refused_from: int | None = None) -> broker_pb2.PublishAck:
    ack = broker_pb2.PublishAck(acked_through_seq=through, duplicates=1, dropped=2)
    if refused_from is not None:
        ack.rejected.append(broker_pb2.PublishRejection(first_seq=refused_from, last_seq=refused_from + 9))
    return ack


def test_merged_acks_add_counters_and_keep_a_live_refusal() -> None:
    merged = _ack(50, refused_from=51)
    _merge(merged, _ack(50, refused_from=61))
    assert merged.acked_through_seq == 50
    assert (merged.duplicates, merged.dropped) == (2, 4)
    assert [r.first_seq for r in merged.rejected] == [51]


def test_a_refusal_overtaken_by_a_later_ack_is_dropped() -> None:
    """The publisher resent 51.. and they were stored: the old refusal must not send it back."""
    merged = _ack(50, refused_from=51)
    _merge(merged, _ack(70))
    assert merged.acked_through_seq == 70
    assert list(merged.rejected) == []
