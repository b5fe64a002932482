"""refuse_nul: every string a request carries (fields, repeated fields, map keys and values, nested
messages at any depth) is checked for NUL, and the error names where the first one is."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from sokutatsu.core.errors import InvalidArgument
from sokutatsu.queuedb.text import refuse_nul
from sokutatsu.queuedb.v1 import queuedb_pb2


def _batch(
    edit: Callable[[queuedb_pb2.PrepareBatchRequest], object] = lambda request: None,
) -> queuedb_pb2.PrepareBatchRequest:
    messages = [
        queuedb_pb2.TransferredMessage(transfer_id=i, queue="inbox", body=b"\x00 bodies are bytes", key=f"k{i}")
        for i in range(1, 4)
    ]
    request = queuedb_pb2.PrepareBatchRequest(
        gid="sokutatsu:node1:1", batch=queuedb_pb2.TransferBatch(sender_node="node1", messages=messages)
    )
    edit(request)
    return request


def test_a_request_without_nul_passes_and_bytes_may_hold_nul() -> None:
    refuse_nul(_batch(lambda r: r.batch.messages[1].headers.update({"h": "v"})))
    refuse_nul(queuedb_pb2.AckRequest(queue="q", lease_ids=["a", "b"]))


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda r: setattr(r, "gid", "a\x00b"), "PrepareBatchRequest.gid has "),
        (lambda r: setattr(r.batch, "sender_node", "n\x00"), "PrepareBatchRequest.batch.sender_node has "),
        (
            lambda r: setattr(r.batch.messages[2], "queue", "in\x00box"),
            "PrepareBatchRequest.batch.messages[2].queue has ",
        ),
        (lambda r: setattr(r.batch.messages[0], "key", "\x00"), "PrepareBatchRequest.batch.messages[0].key has "),
        (
            lambda r: r.batch.messages[1].headers.update({"h\x00": "v"}),
            "PrepareBatchRequest.batch.messages[1].headers has a key ",
        ),
        (
            lambda r: r.batch.messages[1].headers.update({"h": "v\x00"}),
            "PrepareBatchRequest.batch.messages[1].headers['h'] has ",
        ),
    ],
)
def test_the_first_nul_is_named_where_it_is(
    edit: Callable[[queuedb_pb2.PrepareBatchRequest], object], named: str
) -> None:
    with pytest.raises(InvalidArgument, match="NUL character") as refused:
        refuse_nul(_batch(edit))
    assert str(refused.value).startswith(named)


def test_repeated_strings_are_checked() -> None:
    with pytest.raises(InvalidArgument) as refused:
        refuse_nul(queuedb_pb2.AckRequest(queue="q", lease_ids=["a", "b\x00"]))
    assert str(refused.value).startswith("AckRequest.lease_ids has 'b\\x00'")


def test_maps_of_numbers_are_checked_by_their_keys_only() -> None:
    from sokutatsu.broker.v1 import broker_pb2  # noqa: PLC0415 - a map<string, uint64>, which queue-db has none of

    refuse_nul(broker_pb2.Position(last_seq={"publisher-1": 7}))
    with pytest.raises(InvalidArgument) as refused:
        refuse_nul(broker_pb2.Position(last_seq={"pub\x00": 7}))
    assert str(refused.value).startswith("Position.last_seq has a key 'pub\\x00'")
