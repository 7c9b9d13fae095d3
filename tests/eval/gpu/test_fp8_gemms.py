"""`eval/gpu/fp8_gemms.py`'s CPU dry run: every call of every projection timed and written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.engine.model.fp8_support import needs_cpu_product

REPO = Path(__file__).resolve().parents[3]
CALLS = ["bf16", "fp8 exact", "fp8 fast", "quantize", "layer"]


@needs_cpu_product
def test_fp8_gemms_times_each_call_of_each_projection(tmp_path: Path) -> None:
    out = tmp_path / "fp8.json"
    subprocess.run([sys.executable, "eval/gpu/fp8_gemms.py", "--device", "cpu", "--tokens", "2",
                    "65", "--json", str(out)], cwd=REPO, check=True, capture_output=True,
                   text=True)
    rows = json.loads(out.read_text())["rows"]
    assert [(row["projection"], row["tokens"], row["variant"]) for row in rows] == [
        (projection, tokens, call) for projection in ("qkv", "down") for tokens in (2, 65)
        for call in CALLS]
    assert all(row["us"] > 0 and row["host_us"] > 0 for row in rows)
    products = {"fp8 exact", "fp8 fast"}
    assert all((row["weight_tb_per_s"] is not None) == (row["variant"] in {"bf16", *products})
               for row in rows)
    # The CPU kernel accumulates in float32 either way: the fast product is the exact one.
    for row in rows:
        if row["variant"] == "fp8 fast":
            assert row["relative_error"] == 0.0
        else:
            assert row["relative_error"] is None
