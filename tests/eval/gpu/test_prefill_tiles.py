"""`eval/gpu/prefill_tiles.py`'s CPU dry run: every tile is timed and written, and its output
matches the engine's own call's; in the steps of prompts alone, so does SDPA's, and where the
engine splits keys, so do the same call unsplit and split further."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def test_prefill_tiles_times_each_tile_and_checks_it_against_the_engines_call(
        tmp_path: Path) -> None:
    pytest.importorskip("triton")
    out = tmp_path / "tiles.json"
    subprocess.run([sys.executable, "eval/gpu/prefill_tiles.py", "--device", "cpu",
                    "--json", str(out)], cwd=REPO, check=True, capture_output=True, text=True)
    rows = json.loads(out.read_text())["rows"]
    assert {(row["step"], row["tile"]) for row in rows} == {
        (step, tile) for step in ("1 x 40", "2 x 8", "4 over 1,030", "8 over 40, 24")
        for tile in ("auto", "32,32,4,1")} | {("1 x 40", "sdpa"), ("2 x 8", "sdpa")} | {
        ("4 over 1,030", "auto, 1 split"), ("4 over 1,030", "auto, 4 splits")}
    # The chunk over a long context splits its keys (the tile too); the others do not.
    assert {row["step"]: row["num_splits"] for row in rows} == {
        "1 x 40": 1, "2 x 8": 1, "4 over 1,030": 2, "8 over 40, 24": 1}
    assert all(row["us"] > 0 and row["max_diff_vs_auto"] < 1e-5 for row in rows)
    assert all(row["eager_us"] > 0 and row["host_us"] > 0 for row in rows)
