"""Triton kernels for the decoder layers' elementwise work: one kernel where torch launches many.

On the H100 a decode step of Llama-3.1-8B replayed about 1,400 kernels, most of them the few
microseconds of a norm's, rotary's or SiLU's separate elementwise ops, each with its own gap in
the graph (docs/decisions/0024-fused-layer-kernels.md). These kernels fuse each into one:
- `rms_norm`: a residual add (optional) and the RMS norm of its sum, one row per program;
- `rotary_`: rotary embedding of a step's query and key heads, in place, one token per program;
- `silu_and_mul`: `silu(gate) * up`, reading the halves of a fused gate/up product in place;
- `quantize_fp8_rows`: each row's scale and its values in float8 (`engine.model.fp8_linear`).

Each computes what the torch code of `engine.model.layers` and `engine.model.rope` computes,
in float32 between roundings to the activations' dtype. The norm and SiLU round where
torch's ops do (a sum before its norm, a normed row before its weight, `silu` before the
multiply); rotary rounds once where torch rounds each product and the sum (about a quarter
of bf16 values then differ by one unit in the last place, the kernel's nearer the exact
value). Triton's interpreter rounds its casts to 16 bits toward zero, compiled kernels to
nearest. None reads a device value on the host, so all can be captured in a CUDA graph. On
CPU they run under Triton's interpreter (`TRITON_INTERPRET=1`, for tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.model.triton_interpreter import mend_interpreter

if triton.knobs.runtime.interpret:
    mend_interpreter()

_ELEMENTWISE_BLOCK = 1024


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weight * norm(s), s)` for rows `x` [rows, size], where `s` is `x + residual` (or `x`
    without a residual), in x's dtype; both outputs are new tensors."""
    _check_rows("x", x)
    if residual is not None:
        _check_rows("residual", residual)
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match "
                             f"x {tuple(x.shape)} {x.dtype}")
    size = x.shape[1]
    if weight.shape != (size,):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({size},)")
    out = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
    summed = torch.empty_like(x) if residual is not None else x
    if x.shape[0]:
        block = triton.next_power_of_2(size)
        _rms_norm_kernel[(x.shape[0],)](
            x, x.stride(0), residual if residual is not None else x,
            residual.stride(0) if residual is not None else 0,
            weight, out, out.stride(0), summed, summed.stride(0), size, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=_row_warps(block))
    return out, summed


def rotary_(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor,
            table: torch.Tensor) -> None:
    """Rotates `query` [tokens, heads, head_dim] and `key` [tokens, kv_heads, head_dim] in
    place (NeoX half rotation) by the rows `positions` [tokens] of `table` [max_positions,
    head_dim] (cos for the first half of each row, sin for the second, float32). Heads may be
    strided (views into a fused projection); the last dimension must be contiguous."""
    tokens, num_heads, head_dim = query.shape
    if key.shape[0] != tokens or key.shape[2] != head_dim:
        raise ValueError(f"key {tuple(key.shape)} does not match query {tuple(query.shape)}")
    if query.stride(2) != 1 or key.stride(2) != 1:
        raise ValueError("the head dimension of query and key must be contiguous")
    if positions.shape != (tokens,) or table.shape[1] != head_dim or table.stride(1) != 1:
        raise ValueError(f"positions {tuple(positions.shape)} and table "
                         f"{tuple(table.shape)} do not match query {tuple(query.shape)}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if not tokens:
        return
    half = head_dim // 2
    _rotary_kernel[(tokens,)](
        query, query.stride(0), query.stride(1), key, key.stride(0), key.stride(1),
        positions, table, table.stride(0), num_heads, key.shape[1], half,
        BLOCK_Q=triton.next_power_of_2(num_heads), BLOCK_K=triton.next_power_of_2(key.shape[1]),
        BLOCK_D=triton.next_power_of_2(half))


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up`, a new contiguous tensor. `gate` and `up` are rows [rows, size] of
    one shape and dtype with contiguous rows, which may be strided (the two halves of a fused
    gate/up product)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} "
                         f"{up.dtype} differ")
    _check_rows("gate", gate)
    _check_rows("up", up)
    rows, size = gate.shape
    out = torch.empty((rows, size), dtype=gate.dtype, device=gate.device)
    if out.numel():
        block = min(_ELEMENTWISE_BLOCK, triton.next_power_of_2(size))
        _silu_and_mul_kernel[(rows, triton.cdiv(size, block))](
            gate, gate.stride(0), up, up.stride(0), out, size, BLOCK=block)
    return out


def quantize_fp8_rows(x: torch.Tensor, fp8_dtype: torch.dtype, min_scale: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(values, scales)` of rows `x` [rows, size] (contiguous rows): `scales` float32 [rows,
    1], each row's largest magnitude over `fp8_dtype`'s largest value (at least
    `min_scale`), and `values` [rows, size] in `fp8_dtype`, the row over its scale (rounded
    to nearest). One program a row, as `rms_norm`."""
    _check_rows("x", x)
    rows, size = x.shape
    values = torch.empty((rows, size), dtype=fp8_dtype, device=x.device)
    scales = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(size)
        _quantize_fp8_rows_kernel[(rows,)](
            x, x.stride(0), values, scales, size, torch.finfo(fp8_dtype).max, min_scale,
            BLOCK=block, num_warps=_row_warps(block))
    return values, scales


def _row_warps(block: int) -> int:
    """Warps of a one-row-a-program kernel over `block` columns: about 16 values a thread (a
    4,096-wide row takes 8 warps), at most 16 warps."""
    return min(max(block // 512, 1), 16)


def _check_rows(name: str, tensor: torch.Tensor) -> None:
    if tensor.dim() != 2 or tensor.stride(1) != 1:
        raise ValueError(f"{name} must be rows [rows, size] with contiguous rows, got shape "
                         f"{tuple(tensor.shape)} and strides {tensor.stride()}")


@triton.jit
def _rms_norm_kernel(x_ptr, x_row_stride, residual_ptr, residual_row_stride, weight_ptr,
                     out_ptr, out_row_stride, summed_ptr, summed_row_stride, size, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask,
                           other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(residual.dtype)
        tl.store(summed_ptr + row * summed_row_stride + cols, x, mask=mask)
    values = x.to(tl.float32)
    mean_square = tl.sum(values * values, axis=0) / size
    normed = (values * tl.math.rsqrt(mean_square + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _rotate_heads(ptr, token_stride, head_stride, token, num_heads, half, cos, sin,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (dims < half)
    first_ptr = ptr + token * token_stride + heads * head_stride + dims
    first = tl.load(first_ptr, mask=mask, other=0.0)
    second = tl.load(first_ptr + half, mask=mask, other=0.0)
    # torch's path rounds cos and sin to the activations' dtype before rotating.
    cos = cos.to(first.dtype).to(tl.float32)
    sin = sin.to(first.dtype).to(tl.float32)
    first_f, second_f = first.to(tl.float32), second.to(tl.float32)
    tl.store(first_ptr, (first_f * cos - second_f * sin).to(first.dtype), mask=mask)
    tl.store(first_ptr + half, (second_f * cos + first_f * sin).to(first.dtype), mask=mask)


@triton.jit
def _rotary_kernel(query_ptr, query_token_stride, query_head_stride, key_ptr, key_token_stride,
                   key_head_stride, positions_ptr, table_ptr, table_row_stride, num_heads,
                   num_kv_heads, half, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)[None, :]
    dim_mask = dims < half
    cos = tl.load(table_ptr + position * table_row_stride + dims, mask=dim_mask, other=0.0)
    sin = tl.load(table_ptr + position * table_row_stride + half + dims, mask=dim_mask,
                  other=0.0)
    _rotate_heads(query_ptr, query_token_stride, query_head_stride, token, num_heads, half,
                  cos, sin, BLOCK_Q, BLOCK_D)
    _rotate_heads(key_ptr, key_token_stride, key_head_stride, token, num_kv_heads, half,
                  cos, sin, BLOCK_K, BLOCK_D)


@triton.jit
def _silu_and_mul_kernel(gate_ptr, gate_row_stride, up_ptr, up_row_stride, out_ptr, size,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0)
    up = tl.load(up_ptr + row * up_row_stride + cols, mask=mask, other=0.0)
    gate_f = gate.to(tl.float32)
    activated = (gate_f * tl.sigmoid(gate_f)).to(gate.dtype)
    tl.store(out_ptr + row * size + cols,
             (activated.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


@triton.jit
def _quantize_fp8_rows_kernel(x_ptr, x_row_stride, values_ptr, scales_ptr, size, fp8_max,
                              min_scale, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / fp8_max, min_scale)
    quantized = tl.clamp(x / scale, -fp8_max, fp8_max)
    tl.store(values_ptr + row * size + cols, quantized.to(values_ptr.dtype.element_ty),
             mask=mask)
    tl.store(scales_ptr + row, scale)
