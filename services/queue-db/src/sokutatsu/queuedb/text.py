"""Requests' text checked before it reaches PostgreSQL, whose ``text`` (and ``jsonb``) cannot hold NUL."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NoReturn

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from sokutatsu.core.errors import InvalidArgument


@dataclass(frozen=True)
class _Plan:
    """Which fields of one message type can hold text, found once per type (a transfer batch
    checks a thousand messages of one type: the descriptors are not walked for each)."""

    strings: tuple[str, ...]
    repeated_strings: tuple[str, ...]
    maps: tuple[tuple[str, bool], ...]  # (name, whether its values are messages)
    messages: tuple[tuple[str, bool], ...]  # (name, whether repeated)


@functools.cache
def _plan(descriptor: Descriptor) -> _Plan:
    strings: list[str] = []
    repeated_strings: list[str] = []
    maps: list[tuple[str, bool]] = []
    messages: list[tuple[str, bool]] = []
    for field in descriptor.fields:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            maps.append((field.name, field.message_type.fields_by_name["value"].message_type is not None))
        elif field.message_type is not None:
            messages.append((field.name, field.is_repeated))
        elif field.type == FieldDescriptor.TYPE_STRING:
            (repeated_strings if field.is_repeated else strings).append(field.name)
    return _Plan(tuple(strings), tuple(repeated_strings), tuple(maps), tuple(messages))


def refuse_nul(message: Message, where: str = "") -> None:
    """Raise ``InvalidArgument`` naming the first string field of ``message`` (nested, repeated and map
    fields too) that contains a NUL character: PostgreSQL cannot store one in a queue name, a key, a
    header or a node name, so such a request could never be served."""
    _refuse(message, (where or message.DESCRIPTOR.name,))


def _refuse(message: Message, path: tuple[str, ...]) -> None:
    """``path``: where ``message`` is, joined into the error's name only when there is one."""
    plan = _plan(message.DESCRIPTOR)
    for name in plan.strings:
        value = getattr(message, name)
        if "\x00" in value:
            _refused(path, f".{name}", value)
    for name in plan.repeated_strings:
        for value in getattr(message, name):
            if "\x00" in value:
                _refused(path, f".{name}", value)
    for name, of_messages in plan.maps:
        _refuse_map(getattr(message, name), of_messages, path, name)
    for name, repeated in plan.messages:
        if repeated:
            for index, item in enumerate(getattr(message, name)):
                _refuse(item, (*path, f".{name}[{index}]"))
        elif message.HasField(name):
            _refuse(getattr(message, name), (*path, f".{name}"))


def _refuse_map(entries: Any, of_messages: bool, path: tuple[str, ...], name: str) -> None:
    for key, item in entries.items():
        if "\x00" in key:
            _refused(path, f".{name}", key, "a key ")
        if of_messages:
            _refuse(item, (*path, f".{name}[{key!r}]"))
        elif "\x00" in item:
            _refused(path, f".{name}[{key!r}]", item)


def _refused(path: tuple[str, ...], name: str, value: str, what: str = "") -> NoReturn:
    shown = value[:40] + ("…" if len(value) > 40 else "")
    raise InvalidArgument(
        f"{''.join(path)}{name} has {what}{shown!r} with a NUL character (\\x00), which PostgreSQL cannot "
        "store; remove it"
    )
