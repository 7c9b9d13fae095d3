"""`eval/gpu/kernel_codegen.py` compiles the prefill kernel (and its split variant) for sm_90
without a GPU: its K/V loads through the block table are pipelined, and it does not spill."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_a_three_stage_tile_prefetches_its_loads_without_spilling(tmp_path: Path) -> None:
    out = tmp_path / "codegen.json"
    subprocess.run([sys.executable, "eval/gpu/kernel_codegen.py", "--tiles", "64,64,8,2",
                    "64,64,8,3", "--head-dims", "128", "--groups", "4", "--dtypes", "bf16",
                    "--json", str(out)], cwd=REPO, check=True, capture_output=True, text=True)
    two_stages, three_stages = json.loads(out.read_text())
    assert two_stages["async_copies"] > 0  # K and V overlap the tile before
    assert three_stages["async_copies"] > two_stages["async_copies"]  # the block table too
    assert two_stages["spill_bytes"] == three_stages["spill_bytes"] == 0
    assert 0 < three_stages["registers"] <= 255


def test_the_split_variant_pipelines_its_loads_without_spilling(tmp_path: Path) -> None:
    # The variant that splits keys and writes float32 partials (chunks over long contexts).
    out = tmp_path / "codegen.json"
    subprocess.run([sys.executable, "eval/gpu/kernel_codegen.py", "--tiles", "64,64,4,3",
                    "--head-dims", "128", "--groups", "4", "--dtypes", "bf16", "--split",
                    "--json", str(out)], cwd=REPO, check=True, capture_output=True, text=True)
    (code,) = json.loads(out.read_text())
    assert code["split"] is True and code["async_copies"] > 0 and code["spill_bytes"] == 0
