from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.client._wire import varint


@given(st.integers(0, 2**64 - 1))
def test_varint_is_protobufs_encoding(value: int) -> None:
    # Message.publisher_seq is field 2, a varint: tag 0x10 then the value.
    assert broker_pb2.Message.FromString(b"\x10" + varint(value)).publisher_seq == value
    assert broker_pb2.Message(publisher_seq=value).SerializeToString() == (b"\x10" + varint(value) if value else b"")


def test_varint_edges() -> None:
    for value in (0, 1, 127, 128, 16383, 16384, 2**21 - 1, 2**21, 2**63):
        assert broker_pb2.Message.FromString(b"\x10" + varint(value)).publisher_seq == value
