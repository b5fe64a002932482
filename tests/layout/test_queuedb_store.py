"""Queue-db's SQL sits in its store (issue #22): no module of the service outside
``sokutatsu.queuedb.store`` holds a statement on the schema or the catalog. Transaction control
(``BEGIN``, ``COMMIT``, ``ROLLBACK``) stays with the code that holds the transaction."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QUEUEDB = ROOT / "services/queue-db/src/sokutatsu/queuedb"
STATEMENT = re.compile(
    r"\s*(SELECT|INSERT|UPDATE|DELETE|WITH|SET|SHOW|LISTEN|NOTIFY|PREPARE|(COMMIT|ROLLBACK) PREPARED)\s+\S"
)


def _text(node: ast.AST) -> str | None:
    """A string literal's text (an f-string's with ``{}`` for each value)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str | bytes):
        return node.value.decode() if isinstance(node.value, bytes) else node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_text(part) or "{}" for part in node.values)
    return None


def statements(folder: Path) -> list[str]:
    """Where a string literal of a module outside ``store`` and the generated ``v1`` starts as a statement."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        if path.relative_to(folder).parts[0] in {"store", "v1"}:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            text = _text(node)
            if text is not None and STATEMENT.match(text):
                found.append(f"{path.relative_to(folder)}:{getattr(node, 'lineno', 0)}: {text.strip()[:60]}")
    return found


def test_queue_db_statements_are_in_its_store() -> None:
    assert statements(QUEUEDB) == []


def test_the_check_finds_a_statement(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "ok.py").write_text('Q = "SELECT 1"\n')
    (tmp_path / "daemon.py").write_text(
        'A = "BEGIN"\nB = """\nWITH x AS (SELECT 1) SELECT * FROM x"""\nC = b"COMMIT"\n'
        'D = f"LISTEN {A}"\nE = "LISTEN"\n'
    )
    assert statements(tmp_path) == ["daemon.py:2: WITH x AS (SELECT 1) SELECT * FROM x", "daemon.py:5: LISTEN {}"]
