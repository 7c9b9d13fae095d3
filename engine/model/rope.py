"""Rotary position embeddings (NeoX half-rotation layout, as in Hugging Face Llama)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from engine.model.arch import RopeScaling
from engine.model.layers import layer_kernels


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim / 2] in float32, with `scaling` applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class PositionRotary(Protocol):
    """The rotation of one forward pass's positions, shared by every layer."""

    def apply(self, query: torch.Tensor, key: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """`query` [tokens, heads, head_dim] and `key` [tokens, kv_heads, head_dim] rotated
        (new tensors, or the same ones rotated in place)."""
        ...


@dataclass(frozen=True)
class TorchRotary:
    """Rotation by torch ops, with the positions' cos and sin looked up once."""

    cos_sin: tuple[torch.Tensor, ...]

    def apply(self, query: torch.Tensor, key: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        return RotaryEmbedding.apply(self.cos_sin, query, key)


@dataclass(frozen=True)
class TritonRotary:
    """Rotation in place by one kernel a layer (`engine.model.layer_kernels.rotary_`)."""

    positions: torch.Tensor
    table: torch.Tensor

    def apply(self, query: torch.Tensor, key: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        layer_kernels().rotary_(query, key, self.positions, self.table)
        return query, key


class RotaryEmbedding(nn.Module):
    """RoPE from a cos/sin table of `max_positions` rows.

    `for_positions(positions)` is called once per forward pass; the rotation it returns is
    shared by every layer. With `use_triton` it rotates in place by one kernel a layer.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling,
                 use_triton: bool = False):
        super().__init__()
        inv_freq = rope_inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("table", torch.cat([freqs.cos(), freqs.sin()], dim=-1),
                             persistent=False)
        self.use_triton = use_triton

    def for_positions(self, positions: torch.Tensor, dtype: torch.dtype) -> PositionRotary:
        """The rotation of `positions` [tokens] for activations of `dtype`."""
        if self.use_triton:
            return TritonRotary(positions, self.table)
        return TorchRotary(self.cos_sin(positions, dtype))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """(cos, sin), each [tokens, 1, head_dim / 2], in the activations' dtype."""
        return self.table[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)

    @staticmethod
    def apply(
        cos_sin: tuple[torch.Tensor, ...], query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`query` [tokens, heads, head_dim] and `key` [tokens, kv_heads, head_dim]."""
        cos, sin = cos_sin
        return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
