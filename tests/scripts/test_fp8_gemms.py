"""`scripts/fp8_gemms.py`'s CPU dry run: every call of every projection timed and written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.engine.model.fp8_support import needs_cpu_product

REPO = Path(__file__).resolve().parents[2]


@needs_cpu_product
def test_fp8_gemms_times_each_call_of_each_projection(tmp_path: Path) -> None:
    out = tmp_path / "fp8.json"
    subprocess.run([sys.executable, "scripts/fp8_gemms.py", "--device", "cpu", "--tokens", "1",
                    "3", "--json", str(out)], cwd=REPO, check=True, capture_output=True,
                   text=True)
    rows = json.loads(out.read_text())["rows"]
    calls = ["bf16", "fp8 exact", "fp8 fast", "quantize", "layer"]
    assert [(row["projection"], row["tokens"], row["variant"]) for row in rows] == [
        (projection, tokens, call) for projection in ("qkv", "down") for tokens in (1, 3)
        for call in calls]
    assert all(row["us"] > 0 and row["host_us"] > 0 for row in rows)
    # Bytes a second for the products only; the fast product's error beside it alone (zero
    # here: the CPU kernel accumulates in float32 either way).
    assert all((row["weight_tb_per_s"] is not None) == (row["variant"] in calls[:3])
               for row in rows)
    assert all((row["fast_relative_error"] == 0.0) if row["variant"] == "fp8 fast"
               else row["fast_relative_error"] is None for row in rows)
