"""The SDK's hand-written protobuf encoding is exactly what protobuf parses."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.client._wire import batch_frame, encode_message, message_element, publisher_field

texts = st.text(max_size=40)


@settings(max_examples=300)
@given(
    publisher=st.text(min_size=1, max_size=40),
    seq=st.integers(1, 2**64 - 1),
    key=texts,
    body=st.binary(max_size=2000),
    headers=st.dictionaries(texts, texts, max_size=4),
    persistent=st.booleans(),
    time_ns=st.integers(0, 2**64 - 1),
)
def test_encode_message_matches_protobuf(  # noqa: PLR0917 - hypothesis passes every field
    publisher: str, seq: int, key: str, body: bytes, headers: dict[str, str], persistent: bool, time_ns: int
) -> None:
    raw = encode_message(publisher_field(publisher), seq, key, body, headers or None, persistent, time_ns)
    expected = broker_pb2.Message(
        publisher_id=publisher,
        publisher_seq=seq,
        key=key,
        body=body,
        headers=headers,
        persistent=persistent,
        publish_time_unix_nano=time_ns,
    )
    assert broker_pb2.Message.FromString(raw) == expected


@given(topic=st.text(min_size=1, max_size=30), seqs=st.lists(st.integers(1, 2**40), max_size=20))
def test_batch_frame_is_a_publish_request(topic: str, seqs: list[int]) -> None:
    field = publisher_field("p")
    payloads = [encode_message(field, s, "K", b"body", None, True, 1) for s in seqs]
    request = broker_pb2.PublishRequest.FromString(batch_frame(topic, [message_element(p) for p in payloads]))
    assert request.WhichOneof("frame") == "batch"
    assert request.batch.topic == topic
    assert [m.publisher_seq for m in request.batch.messages] == seqs
