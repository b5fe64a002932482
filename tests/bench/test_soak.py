"""``sokutatsu bench soak`` for a few seconds against real processes: the JSON's shape and no loss.

The broker pair, the monitor and the three subscribers are real processes; nothing is
timed here (the figures are in bench/README.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sokutatsu.cli.app import app

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.mark.timeout(150)
def test_a_short_soak_loses_nothing_and_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    args = ["--minutes", "0.3", "--rate", "300", "--queue-budget-mib", "1", "--retention-mib", "1"]
    result = CliRunner().invoke(app, ["bench", "soak", *args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    soak = json.loads(out.read_text())
    assert soak["benchmark"] == "soak"
    assert soak["passed"] is True
    assert all(soak["checks"].values()), soak["checks"]
    sent = soak["published"]["sent"]
    assert sent > 0
    assert soak["published"]["acked_through"] == sent
    for who in ("normal", "slow"):
        assert soak[who]["lost"] == 0, soak[who]
        assert soak[who]["duplicates"] == 0
        assert soak[who]["reordered"] == 0
        assert soak[who]["distinct"] == sent
    # The stalled subscriber took nothing while publishing went on; its queue stayed within its
    # retention on disk (1 MiB, drop_oldest); reading at the end, it was told of all it lost.
    stalled = soak["stalled"]
    assert stalled["connected_at_end"] is True
    assert stalled["lost"] > 0
    assert stalled["lost"] == stalled["told_lost"] == stalled["told_lost_by_reason"]["retention bytes"]
    assert stalled["first_gaps"][0]["reason"] == "retention bytes"
    assert stalled["distinct"] + stalled["lost"] == sent
    assert stalled["duplicates"] == stalled["reordered"] == stalled["gaps_without_reason"] == 0
    assert 0 < max(soak["stalled_disk"]["max_folder_bytes"].values()) <= 2**20
    assert soak["checks"]["stalled_disk_within_retention"] is True
    assert set(soak["max_rss_mib"]) == {"broker-a", "broker-b", "monitor"}
    assert all(value > 0 for value in soak["max_rss_mib"].values())
    assert soak["samples"]
    assert {"t", "rss", "broker-a", "broker-b"} <= set(soak["samples"][0])
    assert soak["minutes"][0]["sent"] > 0
    assert soak["normal"]["per_minute"][0]["count"] == sent
    assert {"cpus", "cpu_model", "memory_bytes", "python", "platform"} <= set(soak["machine"])
    assert Path(soak["plot"]).is_file()
    assert Path(soak["plot"]).suffix == ".png"
