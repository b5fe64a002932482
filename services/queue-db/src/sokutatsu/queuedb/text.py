"""Requests' text checked before it reaches PostgreSQL: names by one rule (:func:`valid_name`), and no NUL
anywhere (PostgreSQL's ``text`` and ``jsonb`` cannot hold one)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NoReturn

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from sokutatsu.core.errors import InvalidArgument, echo
from sokutatsu.core.settings import SettingsError, parse_name


def valid_name(raw: str, what: str) -> str:
    """``raw`` when it is a valid queue or node name (``parse_name``: 1-64 letters, digits, '.', '_' or
    '-', starting with a letter or digit), else ``InvalidArgument`` naming ``what``. The one rule for
    every name a request gives, QueueService's and Transfer's alike, checked before any SQL: a name
    PostgreSQL could not index (``index row requires 10016 bytes``) never reaches it."""
    try:
        return parse_name(raw)
    except SettingsError as exc:
        raise InvalidArgument(
            f"{what} {echo(raw)} is not a valid name: {exc}, starting with a letter or digit"
        ) from None


@dataclass(frozen=True)
class _Plan:
    """Which fields of one message type can hold text, found once per type (a transfer batch
    checks a thousand messages of one type: the descriptors are not walked for each)."""

    strings: tuple[str, ...]
    repeated_strings: tuple[str, ...]
    # (name, whether its keys are text, what its values are: "message", "string" or "other")
    maps: tuple[tuple[str, bool, str], ...]
    messages: tuple[tuple[str, bool], ...]  # (name, whether repeated)


@functools.cache
def _plan(descriptor: Descriptor) -> _Plan:
    strings: list[str] = []
    repeated_strings: list[str] = []
    maps: list[tuple[str, bool, str]] = []
    messages: list[tuple[str, bool]] = []
    for field in descriptor.fields:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key, value = (field.message_type.fields_by_name[n] for n in ("key", "value"))
            kind = (
                "message" if value.message_type else "string" if value.type == FieldDescriptor.TYPE_STRING else "other"
            )
            maps.append((field.name, key.type == FieldDescriptor.TYPE_STRING, kind))
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
    for name, text_keys, values in plan.maps:
        _refuse_map(getattr(message, name), text_keys, values, path, name)
    for name, repeated in plan.messages:
        if repeated:
            for index, item in enumerate(getattr(message, name)):
                _refuse(item, (*path, f".{name}[{index}]"))
        elif message.HasField(name):
            _refuse(getattr(message, name), (*path, f".{name}"))


def _refuse_map(entries: Any, text_keys: bool, values: str, path: tuple[str, ...], name: str) -> None:
    for key, item in entries.items():
        if text_keys and "\x00" in key:
            _refused(path, f".{name}", key, "a key ")
        if values == "message":
            _refuse(item, (*path, f".{name}[{echo(key)}]"))
        elif values == "string" and "\x00" in item:
            _refused(path, f".{name}[{echo(key)}]", item)


def _refused(path: tuple[str, ...], name: str, value: str, what: str = "") -> NoReturn:
    raise InvalidArgument(
        f"{''.join(path)}{name} has {what}{echo(value)} with a NUL character (\\x00), which PostgreSQL cannot "
        "store; remove it"
    )
