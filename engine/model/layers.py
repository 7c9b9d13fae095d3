"""Building blocks shared by the Llama family: RMSNorm and the SwiGLU MLP.

With `use_triton` each runs as one fused kernel (`engine.model.layer_kernels`) instead of
several torch ops; both compute the same values (up to the rounding of intermediate steps).
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, scaled by a learned weight. With
    `use_triton`, inputs are rows [rows, size] with contiguous rows."""

    def __init__(self, size: int, eps: float, use_triton: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.use_triton = use_triton

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            return layer_kernels().rms_norm(x, self.weight, self.eps)[0]
        input_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(input_dtype)

    def forward_with_residual(self, x: torch.Tensor, residual: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(x + residual), x + residual)`: a block's output added to the residual
        stream, and the norm the next block reads."""
        if self.use_triton:
            return layer_kernels().rms_norm(x, self.weight, self.eps, residual)
        summed = x + residual
        return self.forward(summed), summed


class SwiGLUMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))`, with gate and up stored as one matrix `gate_up_proj`
    [2 x intermediate_size, hidden_size], gate's rows first (`LlamaForCausalLM.load_weights`
    maps a checkpoint's two into its halves).

    `fuse_gate_up` picks how it multiplies: one matmul over the whole matrix (on CUDA, where
    one GEMM of twice the width took 0.96-1.01x the time of two on an H100,
    `eval/gpu/mlp_gemms.py`), or one over each half, as views (on CPU one fused matmul
    measured about 4% slower at these shapes, `python -m lab forward`).
    Both compute the same values.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool,
                 use_triton: bool = False, fuse_gate_up: bool = False):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.use_triton = use_triton
        self.fuse_gate_up = fuse_gate_up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._gate_and_up(x)
        if self.use_triton:
            return self.down_proj(layer_kernels().silu_and_mul(gate, up))
        return self.down_proj(F.silu(gate).mul_(up))

    def _gate_and_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(gate(x), up(x))`; with `fuse_gate_up` the two halves of one product (row views
        with a stride of twice their width)."""
        size = self.intermediate_size
        if self.fuse_gate_up:
            gate_up = self.gate_up_proj(x)
            return gate_up[..., :size], gate_up[..., size:]
        weight, bias = self.gate_up_proj.weight, self.gate_up_proj.bias
        return (F.linear(x, weight[:size], None if bias is None else bias[:size]),
                F.linear(x, weight[size:], None if bias is None else bias[size:]))


@functools.cache
def layer_kernels() -> ModuleType:
    """`engine.model.layer_kernels`, imported on first use: Triton is an optional dependency."""
    return importlib.import_module("engine.model.layer_kernels")
