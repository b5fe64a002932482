"""Give podman the settings it needs on this kind of machine, keeping every other setting.

``python3 scripts/containers_conf.py [/etc/containers/containers.conf]`` (scripts/compose_check.sh):

* ``[containers] default_ulimits = []``: the default ulimits podman sets are refused here;
* ``[engine] cgroup_manager = "cgroupfs"``: no systemd runs here;
* ``[engine] runtime = "runc"``: crun is refused here, runc works.

A key already set to that value is left alone; a key set to another value is changed in
place; a missing key is added under its table (the table is added if missing). Every other
line of the file, comments included, stays as it was. Prints what it changed, nothing if
nothing.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

WANTED: dict[str, dict[str, str]] = {
    "containers": {"default_ulimits": "[]"},
    "engine": {"cgroup_manager": '"cgroupfs"', "runtime": '"runc"'},
}
_TABLE = re.compile(r"^\s*\[([A-Za-z0-9_.-]+)\]\s*(#.*)?$")


def merge(text: str) -> tuple[str, list[str]]:
    """The file's text with the wanted settings, and one line per change."""
    current = tomllib.loads(text)
    lines = text.splitlines()
    changes: list[str] = []
    for table, keys in WANTED.items():
        for key, value in keys.items():
            if current.get(table, {}).get(key, None) == tomllib.loads(f"v = {value}")["v"]:
                continue
            lines = _set(lines, table, key, value)
            changes.append(f"[{table}] {key} = {value}")
    merged = "\n".join(lines) + "\n"
    tomllib.loads(merged)  # still TOML, or fail before writing
    return merged, changes


def _set(lines: list[str], table: str, key: str, value: str) -> list[str]:
    start = next((i for i, line in enumerate(lines) if (m := _TABLE.match(line)) and m.group(1) == table), None)
    if start is None:
        return [*lines, f"[{table}]", f"{key} = {value}"]
    end = next((i for i in range(start + 1, len(lines)) if _TABLE.match(lines[i])), len(lines))
    assignment = re.compile(rf"^\s*{re.escape(key)}\s*=")
    for i in range(start + 1, end):
        if assignment.match(lines[i]):
            if lines[i].rstrip().endswith(("[", "{")):
                raise SystemExit(f"containers_conf: {table}.{key} spans several lines: set it to {value} by hand")
            return [*lines[:i], f"{key} = {value}", *lines[i + 1 :]]
    return [*lines[: start + 1], f"{key} = {value}", *lines[start + 1 :]]


def main(argv: list[str]) -> int:
    path = Path(argv[1] if len(argv) > 1 else "/etc/containers/containers.conf")
    text = path.read_text() if path.exists() else ""
    merged, changes = merge(text)
    if changes:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(merged)
        for change in changes:
            print(f"containers_conf: {path}: set {change}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
