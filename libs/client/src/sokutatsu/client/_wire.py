"""Protobuf wire-format helpers for the hand-framed hot paths (the SDK's publish frames, the broker's).

Both sides serialise each message once and build frames by concatenating already-encoded
fields, which protobuf defines as equivalent to encoding the whole message; only varints need
computing, so they are made cheap here. (The broker imports :func:`varint` from here: the
wire format is the protocol's, and the SDK is the distribution every service has.)
"""

from __future__ import annotations


def _varint_slow(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# Every varint of one or two bytes, precomputed (lengths of frames and messages live here).
_SMALL = tuple(_varint_slow(v) for v in range(1 << 14))
_THREE_BYTES = 1 << 21


def varint(value: int) -> bytes:
    """The base-128 varint encoding of a non-negative ``value``."""
    if value < 16384:
        return _SMALL[value]
    if value < _THREE_BYTES:
        return bytes(((value & 0x7F) | 0x80, ((value >> 7) & 0x7F) | 0x80, value >> 14))
    return _varint_slow(value)


_TAG_BATCH = b"\x12"  # PublishRequest.batch = 2
_TAG_TOPIC = b"\x0a"  # PublishBatch.topic = 1
_TAG_MESSAGE = b"\x12"  # PublishBatch.messages = 2


def message_element(payload: bytes) -> bytes:
    return _TAG_MESSAGE + varint(len(payload)) + payload


def batch_frame(topic: str, elements: list[bytes]) -> bytes:
    """A serialised ``PublishRequest`` with a batch of pre-framed messages for ``topic``."""
    name = topic.encode()
    body = b"".join((_TAG_TOPIC, varint(len(name)), name, *elements))
    return b"".join((_TAG_BATCH, varint(len(body)), body))


_TAG_PUBLISHER_ID = b"\x0a"  # Message.publisher_id = 1
_TAG_SEQ = b"\x10"  # Message.publisher_seq = 2, varint
_TAG_KEY = b"\x1a"  # Message.key = 3
_TAG_HEADER = b"\x22"  # Message.headers = 4 (map entry: key = 1, value = 2)
_TAG_BODY = b"\x2a"  # Message.body = 5
_PERSISTENT = b"\x30\x01"  # Message.persistent = 6, true
_TAG_TIME = b"\x39"  # Message.publish_time_unix_nano = 7, fixed64
_TAG_STAMP = b"\x42"  # Message.stamp = 8


def _length_delimited(tag: bytes, data: bytes) -> bytes:
    return tag + varint(len(data)) + data


def encode_message(  # noqa: PLR0917 - one call per message; mirrors the Message fields in order
    publisher_field: bytes,
    seq: int,
    key: str,
    body: bytes,
    headers: dict[str, str] | None,
    persistent: bool,
    time_ns: int,
    stamp: bytes = b"",
    header_fields: bytes = b"",
) -> bytes:
    """A serialised ``Message`` (the same bytes protobuf would write), without building one.

    ``publisher_field`` is the pre-encoded publisher_id field (see :func:`publisher_field`);
    ``stamp`` a serialised sequencer ``Stamp`` (total-order topics) or empty; ``header_fields``
    more headers already encoded (see :func:`header_field`), e.g. the trace context a batch shares.
    """
    parts = [publisher_field, _TAG_SEQ, varint(seq), _length_delimited(_TAG_KEY, key.encode())]
    if headers:
        for name, value in headers.items():
            parts.append(header_field(name, value))
    if header_fields:
        parts.append(header_fields)
    if body:
        parts.append(_length_delimited(_TAG_BODY, body))
    if persistent:
        parts.append(_PERSISTENT)
    parts.append(_TAG_TIME + time_ns.to_bytes(8, "little"))
    if stamp:
        parts.append(_length_delimited(_TAG_STAMP, stamp))
    return b"".join(parts)


def header_field(name: str, value: str) -> bytes:
    """One ``Message.headers`` entry, encoded."""
    entry = _length_delimited(b"\x0a", name.encode()) + _length_delimited(b"\x12", value.encode())
    return _length_delimited(_TAG_HEADER, entry)


def publisher_field(publisher_id: str) -> bytes:
    return _length_delimited(_TAG_PUBLISHER_ID, publisher_id.encode())
