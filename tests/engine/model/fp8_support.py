"""Whether this machine's torch multiplies FP8 rows on the CPU, for tests of FP8 projections.

torch's CPU `_scaled_mm` with rowwise scales failed on the GPU image's torch 2.11
(`scripts/gpu_bench.sh --part smoke`, 2026-11-28); tests of the CPU product skip there and
always run where there is no GPU."""

from __future__ import annotations

import pytest
import torch

from engine.model.fp8_linear import FP8_DTYPE


def cpu_scaled_mm_runs() -> bool:
    """Whether this torch's CPU `_scaled_mm` multiplies float8 rows with rowwise scales, as
    `Fp8Linear` calls it."""
    ones = torch.ones(16, 16).to(FP8_DTYPE)
    try:
        torch._scaled_mm(ones, ones.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True


needs_cpu_product = pytest.mark.skipif(
    torch.cuda.is_available() and not cpu_scaled_mm_runs(),
    reason="this GPU machine's torch has no CPU _scaled_mm with rowwise scales")
