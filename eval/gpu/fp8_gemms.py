"""Times FP8 projections (`--quantization fp8`) against bf16 ones on a GPU, Llama-3.1-8B's shapes.

For each of a decoder layer's four projections (qkv 4,096 -> 6,144, o 4,096 -> 4,096,
gate/up 4,096 -> 28,672, down 14,336 -> 4,096) and each token count, these calls:
- `bf16`: `F.linear` over bf16 weights, the engine's default;
- `fp8 exact`: torch's rowwise `_scaled_mm` with float32 accumulation (`use_fast_accum=False`);
- `fp8 fast`: the same with `use_fast_accum=True`, what `Fp8Linear` calls (vLLM's CUTLASS
  kernels for Hopper accumulate so too; torch's rowwise kernel without it is reported much
  slower);
- `quantize`: the per-token row quantization of the input (`quantize_rows`, the Triton
  kernel on CUDA);
- `layer`: `Fp8Linear.forward` whole, as the engine runs it (quantize, then the fast
  product).
Each has two times a call (`eval.gpu.kernel_timing`): the device's from a replayed CUDA graph and
the host's for an eager call; the products also have the weight bytes a second the device's
time reads. The relative error of `fp8 fast` is its largest difference from the exact
product over that product's largest magnitude (bf16 outputs; random weights and inputs). The
FP8 prefill of the H100 run of 6a474e2 was bound by its host (`_scaled_mm` took 114 us of
host time a call under the profiler); the host column says what a call costs without it.
A batch-1 decode step with FP8 projections read its weights at about 1.4 TB/s there; the
bytes column says which product does better. The graph replays no L2 flush between calls:
the float8 weights of qkv (25 MB) and o (17 MB) fit in an H100's 50 MB L2, so judge rates by
gate/up (117 MB) and down (59 MB).

Usage: python eval/gpu/fp8_gemms.py [--device cuda|cpu] [--tokens N ...] [--json FILE]
  --device cpu  a dry run with small shapes in float32 (the rows named bf16 are float32
                there), torch's quantization, times on the host's clock (CPU `_scaled_mm`
                ignores the accumulation flag)
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from engine.model.fp8_linear import Fp8Linear, quantize_rows
from eval.gpu import kernel_timing

# (name, input features, output features) of Llama-3.1-8B's projections.
PROJECTIONS = (("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672),
               ("down", 14336, 4096))
CPU_PROJECTIONS = (("qkv", 64, 96), ("down", 224, 64))
DEFAULT_TOKENS = (1, 32, 128, 256, 2048)


def _times_us(fn: Callable[[], object], device: torch.device) -> dict[str, float | None]:
    if device.type == "cuda":
        return {"us": kernel_timing.graph_us(fn),
                "host_us": kernel_timing.host_us(fn, torch.cuda.synchronize)}
    host_us = kernel_timing.host_clock_us(fn)
    return {"us": host_us, "host_us": host_us}


def _relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out.float() - reference).abs().max()
            / reference.abs().max().clamp(min=1e-30)).item()


def measure(name: str, in_features: int, out_features: int, tokens: int,
            device: torch.device, dtype: torch.dtype) -> list[dict[str, object]]:
    """One row a call for projection `name` over `tokens` input rows."""
    generator = torch.Generator(device=device).manual_seed(tokens * out_features)
    linear = nn.Linear(in_features, out_features, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=generator,
                                        device=device) * in_features ** -0.5)
    use_triton = device.type == "cuda"
    quantized = Fp8Linear.quantize(linear, use_triton)
    x = torch.randn(tokens, in_features, generator=generator, device=device).to(dtype)
    values, scales = quantize_rows(x, use_triton)

    def product(fast: bool) -> Callable[[], torch.Tensor]:
        return lambda: torch._scaled_mm(values, quantized.weight.t(), scale_a=scales,
                                        scale_b=quantized.weight_scale, out_dtype=dtype,
                                        use_fast_accum=fast)

    products = {"fp8 exact": product(False), "fp8 fast": product(True)}
    calls: dict[str, Callable[[], object]] = {
        "bf16": lambda: F.linear(x, linear.weight), **products,
        "quantize": lambda: quantize_rows(x, use_triton), "layer": lambda: quantized(x)}
    with torch.no_grad():
        exact = product(False)().float()
        errors = {"fp8 fast": _relative_error(product(True)(), exact)}
        weight_bytes = {variant: quantized.weight.numel() for variant in products}
        weight_bytes["bf16"] = linear.weight.numel() * linear.weight.element_size()
        rows = []
        for variant, fn in calls.items():
            times = _times_us(fn, device)
            us, read_bytes = times["us"], weight_bytes.get(variant)
            rows.append({"projection": name, "in": in_features, "out": out_features,
                         "tokens": tokens, "variant": variant, **times,
                         "weight_tb_per_s": (None if us is None or read_bytes is None
                                             else read_bytes / (us * 1e-6) / 1e12),
                         "relative_error": errors.get(variant)})
    return rows


def _cell(value: object, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> int:
    args = kernel_timing.parse_script_arguments(__doc__)
    device = torch.device(args.device)
    if device.type == "cuda":
        projections, dtype = PROJECTIONS, torch.bfloat16
        device_name = torch.cuda.get_device_name()
        tokens = args.tokens or DEFAULT_TOKENS
    else:
        projections, dtype, device_name = CPU_PROJECTIONS, torch.float32, "cpu"
        tokens = args.tokens or (1, 32)
    rows = [row for projection in projections for count in tokens
            for row in measure(*projection, count, device, dtype)]
    print(f"projections, {dtype}, {device_name}, torch {torch.__version__}")
    print("| projection | tokens | call | us (graph) | host us a call | weights read (TB/s) "
          "| relative error |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['projection']} | {row['tokens']} | {row['variant']} | "
              f"{_cell(row['us'], '.1f')} | {_cell(row['host_us'], '.1f')} | "
              f"{_cell(row['weight_tb_per_s'], '.2f')} | "
              f"{_cell(row['relative_error'], '.2e')} |")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(
            {"device": device_name, "torch": torch.__version__, "dtype": str(dtype), "rows": rows},
            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
