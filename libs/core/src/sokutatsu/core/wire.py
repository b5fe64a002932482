"""Protobuf wire-format helpers for hand-framed hot paths (the broker and the SDK).

Both sides serialise each message once and build frames by concatenating
already-encoded fields, which protobuf defines as equivalent to encoding the
whole message; only varints need computing, so they are made cheap here.
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
