"""Hypothesis strategies made from protobuf descriptors, for the fuzz tests (``test_fuzz.py``).

:func:`messages` draws any message of a descriptor: every field type (integers at and past their
edges, floats with NaN and infinities, empty, long and non-ASCII strings, bytes up to and over the
smallest frame limit a service takes, 4 MiB), nested messages, repeated fields, maps, one member (or
none) of each oneof, and enum numbers a schema does not define. :func:`malformed` draws bytes that are not a valid
encoding of a message: random bytes, a valid encoding cut short or with a byte flipped, a length
prefix running past the end, wire types protobuf does not have.

Strings favour a few plausible names (``t``, ``K``, ``a.b``) next to arbitrary text, so that some
requests get past the first validation and reach deeper code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor, ServiceDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

# Over the smallest SOKUTATSU_MAX_FRAME_BYTES (4 MiB), which the fuzz tests give their services.
OVER_FRAME_LIMIT = 4 * 1024 * 1024 + 1
MAX_DEPTH = 3

I32 = (-(2**31), 2**31 - 1)
I64 = (-(2**63), 2**63 - 1)
U32 = (0, 2**32 - 1)
U64 = (0, 2**64 - 1)

PLAUSIBLE_NAMES = ["t", "K", "a.b", "fuzz", "fuzz.topic", "broker-a", "broker-b", "node1", "q1", "a", "b", "1"]
# String fields with these names name something (a topic, a queue, a subscriber...): half the time
# they get a plausible name, so that the request gets past the check of its names.
NAME_FIELDS = {
    "topic",
    "queue",
    "name",
    "subscriber_id",
    "publisher_id",
    "key",
    "keys",
    "exact_keys",
    "prefixes",
    "key_prefixes",
    "sender_node",
    "to_node",
    "to_queue",
    "broker_id",
    "to_broker_id",
    "target_broker_id",
    "from_broker_id",
    "client_id",
    "domain",
    "leader",
    "instance",
}


def _integers(low: int, high: int) -> st.SearchStrategy[int]:
    edges = [low, high, 0, 1, -1, 2**31 - 1, 2**31, 2**32 - 1, 2**53, 2**63 - 1]
    return st.one_of(
        st.sampled_from([e for e in edges if low <= e <= high]),
        st.integers(max(low, 0), min(high, 10)),  # small numbers: counts, sequence numbers, credits
        st.integers(low, high),
    )


def _strings(name: str = "") -> st.SearchStrategy[str]:
    if name in NAME_FIELDS:
        return st.one_of(st.sampled_from(PLAUSIBLE_NAMES), _strings())
    return st.one_of(
        st.sampled_from(["", *PLAUSIBLE_NAMES]),
        st.text(max_size=24),
        st.text(alphabet="日本語é\u0000\ufffd\U0001f600 ./*-_", max_size=12),
        st.builds(lambda c, n: c * n, st.sampled_from(["x", "é", "語", "."]), st.integers(256, 70_000)),
    )


def _bytes() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=64),
        st.builds(bytes, st.sampled_from([1024, 65_537, 1024 * 1024])),
        st.builds(bytes, st.just(OVER_FRAME_LIMIT)),
    )


_BY_TYPE: dict[int, Callable[[], st.SearchStrategy[Any]]] = {
    **dict.fromkeys(
        (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32),
        lambda: _integers(*I32),
    ),
    **dict.fromkeys(
        (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED64),
        lambda: _integers(*I64),
    ),
    **dict.fromkeys((FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32), lambda: _integers(*U32)),
    **dict.fromkeys((FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64), lambda: _integers(*U64)),
    FieldDescriptor.TYPE_BOOL: st.booleans,
    FieldDescriptor.TYPE_FLOAT: lambda: st.floats(width=32),
    FieldDescriptor.TYPE_DOUBLE: st.floats,
    FieldDescriptor.TYPE_BYTES: _bytes,
}


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    if field.type == FieldDescriptor.TYPE_STRING:
        return _strings(field.name)
    if field.type == FieldDescriptor.TYPE_ENUM:
        assert field.enum_type is not None
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), _integers(*I32))  # proto3 enums are open: unknown numbers too
    make = _BY_TYPE.get(field.type)
    assert make is not None, f"no strategy for field {field.full_name} of type {field.type}"
    return make()


def _is_map(field: FieldDescriptor) -> bool:
    return field.message_type is not None and bool(field.message_type.GetOptions().map_entry)


def _nested(field: FieldDescriptor) -> Descriptor:
    assert field.message_type is not None, field.full_name
    return field.message_type


def _is_repeated(field: FieldDescriptor) -> bool:
    return bool(field.is_repeated)


@st.composite
def _message(draw: st.DrawFn, descriptor: Descriptor, depth: int) -> Message:
    message = GetMessageClass(descriptor)()
    in_oneof = {f.name for o in descriptor.oneofs for f in o.fields}
    chosen = [f for f in descriptor.fields if f.name not in in_oneof and draw(st.booleans())]
    for oneof in descriptor.oneofs:
        member = draw(st.sampled_from([None, *oneof.fields]))
        if member is not None:
            chosen.append(member)
    for field in chosen:
        _set(draw, message, field, depth)
    return message


def _set(draw: st.DrawFn, message: Message, field: FieldDescriptor, depth: int) -> None:
    value = getattr(message, field.name)
    if _is_map(field):
        entry = _nested(field)
        key_field, value_field = entry.fields_by_name["key"], entry.fields_by_name["value"]
        for key in draw(st.lists(_scalar(key_field), max_size=4, unique=True)):
            if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                value[key].CopyFrom(draw(_message(_nested(value_field), depth - 1)))
            else:
                value[key] = draw(_scalar(value_field))
    elif field.type == FieldDescriptor.TYPE_MESSAGE:
        if depth <= 0:
            if not _is_repeated(field):
                getattr(message, field.name).SetInParent()
            return
        nested = _message(_nested(field), depth - 1)
        if _is_repeated(field):
            value.extend(draw(st.lists(nested, max_size=3)))
        else:
            value.CopyFrom(draw(nested))
    elif _is_repeated(field):
        value.extend(draw(st.lists(_scalar(field), max_size=5)))
    else:
        setattr(message, field.name, draw(_scalar(field)))


def messages(descriptor: Descriptor, depth: int = MAX_DEPTH) -> st.SearchStrategy[Message]:
    """Any message of ``descriptor`` (see the module docstring)."""
    return _message(descriptor, depth)


def malformed(descriptor: Descriptor) -> st.SearchStrategy[bytes]:
    """Bytes that are (mostly) not a valid encoding of a ``descriptor`` message."""
    valid = messages(descriptor, depth=2).map(lambda m: m.SerializeToString())

    def cut(data: bytes, at: int) -> bytes:
        return data[: at % len(data)] if data else b"\x0a"

    def flip(data: bytes, at: int, bits: int) -> bytes:
        if not data:
            return b"\xff"
        i = at % len(data)
        return data[:i] + bytes([data[i] ^ (bits or 1)]) + data[i + 1 :]

    return st.one_of(
        st.binary(min_size=1, max_size=256),
        st.builds(cut, valid, st.integers(0, 2**16)),
        st.builds(flip, valid, st.integers(0, 2**16), st.integers(0, 255)),
        st.sampled_from(
            [
                b"\x0a\xff\xff\xff\xff\x0f",  # field 1, length 2^32-1, nothing after
                b"\x0a\x05ab",  # length past the end
                b"\x0f",  # wire type 7 does not exist
                b"\x0e\x00",  # wire type 6 does not exist
                b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # an 11-byte varint
                b"\x0b" * 200,  # start-group tags never ended
                b"\x0c",  # end-group with no start
                b"\x00",  # field number 0
                b"\xf8\xff\xff\xff\x0f\x01",  # field number 2^29-1 (the largest, unknown)
                b"\xff\xff\xff\xff not a protobuf",
            ]
        ),
    )


def request_class(method: MethodDescriptor) -> type[Message]:
    return GetMessageClass(method.input_type)


def path(method: MethodDescriptor) -> str:
    """The gRPC path of ``method``: ``/package.Service/Method``."""
    service: ServiceDescriptor = method.containing_service
    return f"/{service.full_name}/{method.name}"
