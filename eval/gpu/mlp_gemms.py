"""Times the MLP's gate and up projections as one matmul and as two, on a GPU.

`SwiGLUMLP` stores gate and up as one matrix [2 x intermediate, hidden] and, with
`fuse_gate_up` (the loader's choice on CUDA), multiplies by it once; otherwise it multiplies
by each half (CPU). This script measures that choice at Llama-3.1-8B's shapes (hidden 4,096,
intermediate 14,336, bf16 on CUDA) for the token counts a step has: decode batches of 1 to
256 and prefill chunks of 2,048 and more. Each variant is timed by
`triton.testing.do_bench` (the median, in device events, after warm-up); the weights, 235 MB
in bf16, outlast the GPU's L2 cache, so back-to-back calls do not read them from it. Printed:
microseconds of each, the fused one's time over the separate ones', and the weight bytes a
second the fused one reads; `--json` writes the rows.

Usage: python eval/gpu/mlp_gemms.py [--device cuda|cpu] [--tokens N ...] [--json FILE]
  --device cpu  a dry run with small shapes, times taken on the host's clock
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from eval.gpu import kernel_timing

HIDDEN, INTERMEDIATE = 4096, 14336
DEFAULT_TOKENS = (1, 8, 32, 64, 128, 192, 256, 2048, 2304, 4096)


def _time_us(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        return kernel_timing.eager_us(fn)
    return kernel_timing.host_clock_us(fn)


def measure(tokens: int, hidden: int, intermediate: int, dtype: torch.dtype,
            device: torch.device, generator: torch.Generator) -> dict[str, float]:
    """Microseconds of the fused and the separate products of `tokens` rows."""
    weight = (torch.randn(2 * intermediate, hidden, generator=generator, device=device)
              * 0.02).to(dtype)
    x = torch.randn(tokens, hidden, generator=generator, device=device).to(dtype)
    gate_w, up_w = weight[:intermediate], weight[intermediate:]
    fused = _time_us(lambda: F.linear(x, weight), device)
    separate = _time_us(lambda: (F.linear(x, gate_w), F.linear(x, up_w)), device)
    weight_bytes = weight.numel() * weight.element_size()
    return {"tokens": tokens, "fused_us": fused, "separate_us": separate,
            "fused_over_separate": fused / separate,
            "fused_weight_tb_per_s": weight_bytes / (fused * 1e-6) / 1e12}


def main() -> int:
    args = kernel_timing.parse_script_arguments(__doc__)
    device = torch.device(args.device)
    if device.type == "cuda":
        hidden, intermediate, dtype = HIDDEN, INTERMEDIATE, torch.bfloat16
        tokens = args.tokens or DEFAULT_TOKENS
        name = torch.cuda.get_device_name()
    else:
        hidden, intermediate, dtype = 256, 896, torch.float32
        tokens = args.tokens or (1, 32, 256)
        name = "cpu"
    generator = torch.Generator(device=device).manual_seed(0)
    rows = [measure(count, hidden, intermediate, dtype, device, generator) for count in tokens]
    print(f"gate/up projections, hidden {hidden}, intermediate {intermediate}, {dtype}, {name}, "
          f"torch {torch.__version__}")
    print("| tokens | fused (us) | separate (us) | fused / separate | fused reads (TB/s) |")
    print("|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['tokens']} | {row['fused_us']:.1f} | {row['separate_us']:.1f} | "
              f"{row['fused_over_separate']:.3f} | {row['fused_weight_tb_per_s']:.2f} |")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(
            {"device": name, "torch": torch.__version__, "hidden": hidden,
             "intermediate": intermediate, "dtype": str(dtype), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
