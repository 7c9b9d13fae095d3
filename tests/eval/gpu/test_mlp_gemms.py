"""`eval/gpu/mlp_gemms.py`'s CPU dry run: both ways of the gate/up product timed and written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def test_mlp_gemms_times_the_fused_and_the_separate_products(tmp_path: Path) -> None:
    out = tmp_path / "gemms.json"
    subprocess.run([sys.executable, "eval/gpu/mlp_gemms.py", "--device", "cpu", "--tokens", "1",
                    "4", "--json", str(out)], cwd=REPO, check=True, capture_output=True,
                   text=True)
    rows = json.loads(out.read_text())["rows"]
    assert [row["tokens"] for row in rows] == [1, 4]
    assert all(row["fused_us"] > 0 and row["separate_us"] > 0 for row in rows)
    assert all(row["fused_over_separate"] == pytest.approx(row["fused_us"] / row["separate_us"])
               for row in rows)
