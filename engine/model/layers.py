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
    """`down(silu(gate(x)) * up(x))`.

    Gate and up stay two matmuls: on CPU one fused matmul measured about 4% slower at these
    shapes (`continuum bench forward`), and the activation then reads strided halves.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool,
                 use_triton: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.use_triton = use_triton

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            return self.down_proj(layer_kernels().silu_and_mul(self.gate_proj(x),
                                                                self.up_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)).mul_(self.up_proj(x)))


@functools.cache
def layer_kernels() -> ModuleType:
    """`engine.model.layer_kernels`, imported on first use: Triton is an optional dependency."""
    return importlib.import_module("engine.model.layer_kernels")
