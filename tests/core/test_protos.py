"""The committed generated code is exactly what `make protos` produces."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# make protos writes the areas the client SDK speaks to libs/client, the rest to libs/core.
COMMITTED = (ROOT / "libs" / "core" / "src", ROOT / "libs" / "client" / "src")


def _generated(base: Path) -> dict[str, str]:
    return {
        str(p.relative_to(base)): p.read_text()
        for p in sorted(base.glob("sokutatsu/*/v1/*"))
        if p.is_file() and p.suffix in {".py", ".pyi"}
    }


def test_generated_code_matches_the_protos(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    fresh = _generated(tmp_path)
    committed = {name: text for base in COMMITTED for name, text in _generated(base).items()}
    assert fresh, "the generator produced nothing"
    assert sorted(fresh) == sorted(committed), "files differ; run `make protos`"
    drifted = [name for name in fresh if fresh[name] != committed[name]]
    assert not drifted, f"generated code is stale, run `make protos`: {drifted}"


def test_the_client_carries_the_stubs_it_speaks() -> None:
    """sokutatsu-client installs without sokutatsu-core: the broker's and the sequencer's stubs are its own."""
    client = {name.split("/")[1] for name in _generated(COMMITTED[1])}
    core = {name.split("/")[1] for name in _generated(COMMITTED[0])}
    assert client == {"broker", "sequencer"}
    assert core == {"monitor", "queuedb", "core"}


def test_every_area_has_a_v1_api() -> None:
    areas = {p.parent.parent.name for p in (ROOT / "protos").glob("sokutatsu/*/v1/*.proto")}
    assert areas == {"broker", "monitor", "sequencer", "queuedb", "core"}
