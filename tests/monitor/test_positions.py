"""Whether the switch position covers the taking broker's floor (step 2's safety check)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.monitor.positions import behind, covers, describe_behind, vector


def test_equal_or_ahead_covers() -> None:
    assert covers({"p1": 5, "p2": 9}, {"p1": 5, "p2": 3})


def test_one_publisher_behind_does_not_cover() -> None:
    assert not covers({"p1": 5, "p2": 2}, {"p1": 5, "p2": 3})
    assert behind({"p1": 5, "p2": 2}, {"p1": 5, "p2": 3}) == {"p2": (2, 3)}


def test_publisher_missing_from_the_position_counts_as_zero() -> None:
    assert not covers({}, {"p1": 1})
    assert covers({}, {"p1": 0})


def test_publisher_missing_from_the_floor_is_covered() -> None:
    """The taking broker holds everything of a publisher its floor does not name."""
    assert covers({"p1": 4}, {})
    assert covers({}, {})


def test_describe_names_the_first_few() -> None:
    floor = {f"p{i}": 10 for i in range(5)}
    text = describe_behind({}, floor)
    assert text == "p0 at 0 < 10, p1 at 0 < 10, p2 at 0 < 10 and 2 more"


def test_vector_of_a_proto_position() -> None:
    assert vector(broker_pb2.Position(last_seq={"a": 3})) == {"a": 3}


names = st.sampled_from(["a", "b", "c", "d"])
vectors = st.dictionaries(names, st.integers(min_value=0, max_value=100))


@given(position=vectors, floor=vectors, extra=vectors)
def test_covers_is_a_per_publisher_order(
    position: dict[str, int], floor: dict[str, int], extra: dict[str, int]
) -> None:
    assert covers(position, floor) == all(position.get(p, 0) >= f for p, f in floor.items())
    assert covers(position, position)
    # Moving the position forward never uncovers.
    ahead = {p: max(position.get(p, 0), extra.get(p, 0)) for p in position.keys() | extra.keys()}
    if covers(position, floor):
        assert covers(ahead, floor)
