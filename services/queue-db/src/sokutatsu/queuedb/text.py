"""Requests' text checked before it reaches PostgreSQL, whose ``text`` (and ``jsonb``) cannot hold NUL."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from sokutatsu.core.errors import InvalidArgument


def refuse_nul(message: Message, where: str = "") -> None:
    """Raise ``InvalidArgument`` naming the first string field of ``message`` (nested, repeated and map
    fields too) that contains a NUL character: PostgreSQL cannot store one in a queue name, a key, a
    header or a node name, so such a request could never be served."""
    where = where or message.DESCRIPTOR.name
    for field, value in message.ListFields():
        name = f"{where}.{field.name}"
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            for key, item in value.items():
                _check(name, [key], "a key")
                if isinstance(item, Message):
                    refuse_nul(item, f"{name}[{key!r}]")
                else:
                    _check(f"{name}[{key!r}]", [item], "")
        elif field.message_type is not None:
            items = value if field.is_repeated else [value]
            for index, item in enumerate(items):
                refuse_nul(item, f"{name}[{index}]" if field.is_repeated else name)
        elif field.type == FieldDescriptor.TYPE_STRING:
            _check(name, value if field.is_repeated else [value], "")


def _check(name: str, values: Iterable[Any], what: str) -> None:
    for value in values:
        if isinstance(value, str) and "\x00" in value:
            shown = value[:40] + ("…" if len(value) > 40 else "")
            raise InvalidArgument(
                f"{name} has {what + ' ' if what else ''}{shown!r} with a NUL character (\\x00), which PostgreSQL "
                "cannot store; remove it"
            )
