"""`scripts/sampler_cost.py --part device`'s CPU dry run (the radix select under the
interpreter): the sort and each digit width of the radix select timed on each filter, and
the tokens they keep compared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]


def test_the_device_part_times_both_searches_and_compares_them(tmp_path: Path) -> None:
    out = tmp_path / "top_p.json"
    subprocess.run([sys.executable, "scripts/sampler_cost.py", "--part", "device", "--device",
                    "cpu", "--vocab-size", "300", "--rows", "1", "--calls", "1", "--runs", "1",
                    "--json", str(out)], cwd=REPO, check=True, capture_output=True, text=True,
                   env={**os.environ, "TRITON_INTERPRET": "1"})
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["vocab_size"] == 300
    assert [(row["scale"], row["filter"]) for row in report["rows"]] == [
        (1.0, "top-p 0.9"), (1.0, "top-p 0.9, top-k 50 on half"),
        (8.0, "top-p 0.9"), (8.0, "top-p 0.9, top-k 50 on half")]
    for row in report["rows"]:
        assert row["rows"] == 1
        assert row["sort_ms"] > 0 and row["radix4_ms"] > 0 and row["radix2_ms"] > 0
        assert row["radix4_rows_differing"] == row["radix2_rows_differing"] == 0
        assert row["radix4_tokens_differing"] == row["radix2_tokens_differing"] == 0
