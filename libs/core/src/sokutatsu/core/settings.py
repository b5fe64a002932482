"""Settings from environment variables, with documented defaults.

A service declares one frozen dataclass of settings; each field is made with
:func:`setting`, which names its variable (relative to the class's
``env_prefix``), its default, a parser and a sentence of documentation::

    @dataclass(frozen=True)
    class BrokerSettings(ServiceSettings):
        env_prefix: ClassVar[str] = "SOKUTATSU_BROKER_"
        listen: str = setting("LISTEN", "127.0.0.1:7201", "host:port to serve on.", parse_address)

:func:`load` reads the environment and raises :class:`SettingsError` with a
one-line message naming the variable when a value is malformed, or when a
variable under the class's prefix is unknown (a typo would otherwise be
silently ignored), with the likeliest intended name. A class whose prefix is
shared (``RuntimeSettings``: ``SOKUTATSU_``) lists the names and prefixes other
classes own (``names_elsewhere``, ``prefixes_elsewhere``), so any
``SOKUTATSU_*`` variable that no class reads is refused by every process.
:func:`describe` lists every knob for the docs and for ``sokutatsu config``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

T = TypeVar("T")
S = TypeVar("S", bound="Settings")


class SettingsError(ValueError):
    """A variable has a value the service cannot use. The message is one line."""


@dataclass(frozen=True)
class Knob:
    """Everything known about one setting: what ``describe`` reports."""

    env: str
    default: str
    doc: str


@dataclass(frozen=True)
class _Spec:
    name: str
    default: object
    doc: str
    parse: Callable[[str], object]


def setting(name: str, default: T, doc: str, parse: Callable[[str], T] | None = None) -> T:
    """Declare a dataclass field read from ``env_prefix + name``."""
    parser: Callable[[str], object] = parse if parse is not None else _parser_for(default)
    spec = _Spec(name=name, default=default, doc=doc, parse=parser)
    field: T = dataclasses.field(default=default, metadata={"setting": spec})
    return field


@dataclass(frozen=True)
class Settings:
    """Base of every settings class."""

    env_prefix: ClassVar[str] = "SOKUTATSU_"
    # Whether unknown variables under env_prefix are an error.
    check_unknown: ClassVar[bool] = True
    # Variables under env_prefix that other settings classes read, so are not unknown here:
    # exact names, and prefixes whose own class checks every name under them.
    names_elsewhere: ClassVar[frozenset[str]] = frozenset()
    prefixes_elsewhere: ClassVar[tuple[str, ...]] = ()


def _specs(cls: type[Settings]) -> list[tuple[str, _Spec]]:
    out = []
    for field in dataclasses.fields(cls):
        spec = field.metadata.get("setting")
        if isinstance(spec, _Spec):
            out.append((field.name, spec))
    return out


def load(cls: type[S], environ: Mapping[str, str] | None = None) -> S:
    """Build ``cls`` from ``environ`` (default ``os.environ``)."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    known = set()
    for attr, spec in _specs(cls):
        var = cls.env_prefix + spec.name
        known.add(var)
        raw = env.get(var)
        if raw is None:
            continue
        try:
            values[attr] = spec.parse(raw.strip())
        except (ValueError, SettingsError) as exc:
            raise SettingsError(f"{var}={raw!r}: {exc} ({spec.doc})") from None
    if cls.check_unknown:
        names = known | cls.names_elsewhere
        for var in sorted(env):
            if not var.startswith(cls.env_prefix) or var in names:
                continue
            if var.startswith(cls.prefixes_elsewhere):
                continue  # the class owning that prefix checks it
            raise SettingsError(_unknown(var, cls.env_prefix, names, cls.prefixes_elsewhere))
    return cls(**values)


def _unknown(var: str, prefix: str, names: set[str] | frozenset[str], prefixes: tuple[str, ...]) -> str:
    """The one-line message for an unknown variable, with the likeliest intended name.

    Names are compared without the common ``prefix`` (which would make every
    name look alike); a misspelt service prefix (``SOKUTATSU_BROKR_LISTEN``)
    is mended, keeping the rest of the name.
    """
    rest = var[len(prefix) :]
    candidates = [(difflib.SequenceMatcher(None, rest, n[len(prefix) :]).ratio(), n) for n in sorted(names)]
    candidates = [c for c in candidates if c[0] >= 0.6]
    for owned in prefixes:
        head = owned[len(prefix) :]
        for cut in range(2, len(rest)):
            score = difflib.SequenceMatcher(None, rest[:cut], head).ratio()
            if score >= 0.85 and rest[cut:].strip("_"):
                candidates.append((score, owned + rest[cut:].lstrip("_")))
    if candidates:
        return f"{var}: unknown variable; did you mean {max(candidates)[1]}?"
    under = f"; or a name under {', '.join(prefixes)}" if prefixes else ""
    return f"{var}: unknown variable; known: {', '.join(sorted(names))}{under}"


def describe(cls: type[Settings]) -> list[Knob]:
    """Every knob of ``cls`` with its variable, default and documentation."""
    return [Knob(env=cls.env_prefix + spec.name, default=_show(spec.default), doc=spec.doc) for _, spec in _specs(cls)]


def _show(value: object) -> str:
    if value is None or value == "":
        return "(unset)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value) or "(empty)"
    return str(value)


# ------------------------------------------------------------------ parsers --

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_bool(raw: str) -> bool:
    low = raw.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise SettingsError("expected true or false")


def parse_int(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise SettingsError("expected a whole number") from None


def parse_positive_float(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError("expected a number") from None
    if not value > 0 or value == float("inf"):
        raise SettingsError("expected a number greater than 0")
    return value


def parse_address(raw: str) -> str:
    """``host:port`` with a port in 0..65535 (0 = any free port)."""
    host, sep, port = raw.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise SettingsError("expected host:port, e.g. 127.0.0.1:7201")
    return raw


_SIZE = re.compile(r"^(\d+)\s*(B|KB|KiB|MB|MiB|GB|GiB)?$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 1000, "kib": 1024, "mb": 10**6, "mib": 2**20, "gb": 10**9, "gib": 2**30}


def parse_size(raw: str) -> int:
    """A byte count: ``1048576``, ``64MiB``, ``1GB``."""
    match = _SIZE.match(raw)
    if not match:
        raise SettingsError("expected a size such as 1048576, 64MiB or 1GB")
    return int(match.group(1)) * _UNITS[(match.group(2) or "b").lower()]


def parse_optional_path(raw: str) -> Path | None:
    return Path(raw) if raw else None


def whole(low: int, high: int, unit: str) -> Callable[[str], int]:
    """A parser of whole numbers from ``low`` to ``high`` (``"5"``, ``"5.0"`` and ``"5e3"`` are whole)."""

    def parse(raw: str) -> int:
        try:
            value = float(raw)
        except ValueError:
            raise SettingsError(f"expected whole {unit} from {low} to {high}, e.g. {low}") from None
        if not math.isfinite(value) or value != int(value) or not low <= value <= high:
            raise SettingsError(f"expected whole {unit} from {low} to {high}")
        return int(value)

    return parse


def named_addresses(raw: str, what: str) -> tuple[tuple[str, str], ...]:
    """``a=127.0.0.1:7102,b=127.0.0.1:7103`` as ``(name, host:port)`` pairs, each name once
    (empty = none). ``what`` names the left side in errors, e.g. ``domain``."""
    pairs = []
    for item in (part.strip() for part in raw.split(",")):
        if not item:
            continue
        name, sep, address = item.partition("=")
        if not sep:
            raise SettingsError(f"expected {what}=host:port, comma-separated; got {item!r}")
        pairs.append((parse_name(name.strip()), parse_address(address.strip())))
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise SettingsError(f"a {what} is named twice in {names}")
    return tuple(pairs)


def choice(*values: str) -> Callable[[str], str]:
    """A parser accepting exactly one of ``values``."""
    expected = " or ".join(values) if len(values) <= 2 else ", ".join(values[:-1]) + " or " + values[-1]

    def parse(raw: str) -> str:
        if raw not in values:
            raise SettingsError(f"expected {expected}")
        return raw

    return parse


def parse_log_level(raw: str) -> str:
    level = raw.upper()
    if level not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
        raise SettingsError("expected DEBUG, INFO, WARNING or ERROR")
    return level


def parse_name(raw: str) -> str:
    """An identifier: letters, digits, '-', '_' and '.', 1 to 64 characters."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", raw):
        raise SettingsError("expected 1-64 letters, digits, '.', '_' or '-'")
    return raw


def _parser_for(default: object) -> Callable[[str], object]:
    if isinstance(default, bool):
        return parse_bool
    if isinstance(default, int):
        return parse_int
    if isinstance(default, float):
        return parse_positive_float
    return str
