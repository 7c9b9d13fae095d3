"""Products of a few rows by float8 weights, the weights widened in registers: a Triton kernel.

At decode sizes a projection reads its weights once for a handful of rows, so its time is
the weights' bytes over the memory's rate. The FP8 projections of the H100 run of 6a474e2
read theirs far below that rate: with `--quantization fp8` a batch-1 decode step took 5.59
ms against 6.42 in bf16, though it reads 8.0 GB of weights instead of 15.0 (docs/
benchmarks.md, "Measured a fifth time"), about 1.4 TB/s for torch's rowwise `_scaled_mm`
against 2.4 TB/s for cuBLAS's bf16 products. `fp8_small_matmul` computes
`y = (x W^T) * s_w` for `x` [rows, in] in bf16 (or float16, float32) and `W` float8 e4m3
[out, in] with a scale per output channel, without quantizing `x`: each program widens a
tile of weights to `x`'s dtype and multiplies it by the rows (`tl.dot`, float32 sums), and
the reduction over `in` is split between programs (`split_k`) so that a projection of 4,096
outputs still fills an H100's 132 SMs. The splits' float32 partials are summed by torch.

The rows are not rounded to float8 here, so the product is closer to the bf16 one than
`_scaled_mm`'s; a step whose rows go here and the same rows in a larger step differ by that
rounding. `engine.model.fp8_linear.SMALL_MATMUL_MAX_ROWS` says which products take it.
Under Triton's interpreter (`TRITON_INTERPRET=1`) it runs on CPU tensors, for tests.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.model.triton_interpreter import mend_interpreter

if triton.knobs.runtime.interpret:
    mend_interpreter()

# The most rows a product takes here: beyond it the product stops being bound by the weights'
# bytes, and float8 tensor cores (`_scaled_mm`) multiply faster.
MAX_ROWS = 64
_MIN_DOT_ROWS = 16  # tl.dot needs M >= 16
_ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Programs enough to fill an H100's 132 SMs twice over, as the attention kernels' split rules.
_TARGET_PROGRAMS = 2 * 132
# A split covers at least this many of `in`: fewer would not repay the partials' traffic.
_MIN_SPLIT_K = 512


class SmallMatmulTile(NamedTuple):
    """Output columns and reduction positions a program's tile holds, its warps and stages."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


DEFAULT_TILE = SmallMatmulTile(block_n=64, block_k=128, num_warps=4, num_stages=4)


def split_k(out_features: int, in_features: int, tile: SmallMatmulTile) -> int:
    """How many programs share each column tile's reduction (one program holds every row):
    enough column tiles times splits to reach `_TARGET_PROGRAMS`, no split under
    `_MIN_SPLIT_K` positions, a power of two."""
    column_tiles = triton.cdiv(out_features, tile.block_n)
    wanted = triton.cdiv(_TARGET_PROGRAMS, column_tiles)
    most = max(in_features // max(_MIN_SPLIT_K, tile.block_k), 1)
    splits = max(min(wanted, most), 1)
    return 1 << (splits.bit_length() - 1)


def fp8_small_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     tile: SmallMatmulTile = DEFAULT_TILE) -> torch.Tensor:
    """`(x W^T) * weight_scale` in `x`'s dtype: `x` rows [rows, in] (contiguous rows, at most
    `MAX_ROWS`; bfloat16, float16 or float32), `weight` float8 e4m3 [out, in] (row-major),
    `weight_scale` float32 [1, out] (or [out]). Sums in float32. A new tensor [rows, out]."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be rows [rows, in] with contiguous rows, got shape "
                         f"{tuple(x.shape)} and strides {x.stride()}")
    if x.dtype not in _ROW_DTYPES or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_small_matmul multiplies rows of {_ROW_DTYPES} by float8 e4m3 "
                         f"weights, got {x.dtype} and {weight.dtype}")
    rows, in_features = x.shape
    out_features = weight.shape[0]
    if rows > MAX_ROWS:
        raise ValueError(f"fp8_small_matmul takes at most {MAX_ROWS} rows, got {rows}")
    if weight.shape != (out_features, in_features) or weight.stride(1) != 1:
        raise ValueError(f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)} or "
                         f"its rows are not contiguous")
    if weight_scale.numel() != out_features or weight_scale.dtype != torch.float32:
        raise ValueError(f"weight_scale must be {out_features} float32 values, got "
                         f"{weight_scale.numel()} of {weight_scale.dtype}")
    weight_scale = weight_scale.reshape(-1).contiguous()
    out = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    k_per_split = triton.cdiv(triton.cdiv(in_features, split_k(out_features, in_features, tile)),
                              tile.block_k) * tile.block_k
    # Whole tiles a split can leave the last splits nothing: launch only those with keys.
    splits = triton.cdiv(in_features, k_per_split)
    partials = (out if splits == 1 else
                torch.empty((splits, rows, out_features), dtype=torch.float32, device=x.device))
    grid = (triton.cdiv(out_features, tile.block_n), splits)
    _small_matmul_kernel[grid](
        x, x.stride(0), weight, weight.stride(0), weight_scale, partials,
        partials.stride(-2), rows * out_features, rows, out_features, in_features, k_per_split,
        BLOCK_M=max(_MIN_DOT_ROWS, triton.next_power_of_2(rows)), BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, SPLIT=splits > 1,
        # float32 rows in TF32 would be off by ~1e-3: full precision where asked for it.
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=tile.num_warps,
        num_stages=tile.num_stages)
    if splits > 1:
        out.copy_(partials.sum(dim=0))
    return out


@triton.jit
def _small_matmul_kernel(x_ptr, stride_xm, w_ptr, stride_wn, scale_ptr, out_ptr, stride_om,
                         split_stride, rows, out_features, in_features, k_per_split,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    column_tile = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.arange(0, BLOCK_M)
    column = column_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = row < rows
    column_ok = column < out_features
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, in_features)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        position = k + tl.arange(0, BLOCK_K)
        position_ok = position < k_end
        x = tl.load(x_ptr + row[:, None].to(tl.int64) * stride_xm + position[None, :],
                    mask=row_ok[:, None] & position_ok[None, :], other=0.0)
        w = tl.load(w_ptr + column[:, None].to(tl.int64) * stride_wn + position[None, :],
                    mask=column_ok[:, None] & position_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)
    acc *= tl.load(scale_ptr + column, mask=column_ok, other=0.0)[None, :]
    offsets = row[:, None].to(tl.int64) * stride_om + column[None, :]
    mask = row_ok[:, None] & column_ok[None, :]
    if SPLIT:
        tl.store(out_ptr + split.to(tl.int64) * split_stride + offsets, acc, mask=mask)
    else:
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)
