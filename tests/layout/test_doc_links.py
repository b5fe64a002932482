"""The README and docs link nothing outside the repository, and every link inside it resolves:
the file exists and, with a ``#fragment``, so does a heading of that name (GitHub's anchors)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "bench/README.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _anchors(doc: Path) -> set[str]:
    """GitHub's anchor for each heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    found: set[str] = set()
    for line in FENCE.sub("", doc.read_text()).splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
            found.add(slug)
    return found


def _links(doc: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", doc.read_text()))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_stay_inside_the_repository_and_resolve(doc: Path) -> None:
    broken = []
    for target in _links(doc):
        if re.match(r"^[a-z]+:", target):
            broken.append(f"{target}: a link outside the repository")
            continue
        path, _, fragment = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
        elif not file.exists():
            broken.append(f"{target}: no such file")
        elif fragment and file.suffix == ".md" and fragment not in _anchors(file):
            broken.append(f"{target}: no heading #{fragment} in {file.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_the_check_sees_a_link_that_leaves() -> None:
    assert _links(ROOT / "README.md"), "the README has links: the pattern finds them"
    assert (ROOT / "../shared/ARCHITECTURE.md").resolve().is_relative_to(ROOT) is False
