"""Attention backends: the seam (`backend.py`) and its implementations, chosen by name.

- `sdpa`: attention in torch (K/V gathered out of the paged cache, then SDPA); every device.
- `triton`: Triton kernels reading K/V in place through the block table; CUDA (or CPU under
  Triton's interpreter, for tests); decode plans over static buffers for CUDA graphs.
- `triton-sdpa`: `triton`, but long prompts with no cached prefix are attended by torch's
  SDPA (its flash kernel on CUDA) over the step's own K/V.
- `auto`: `triton-sdpa` on CUDA where Triton is installed and its kernels cover the layout
  (head dim and block size), else `sdpa` (docs/decisions/0009-triton-sdpa.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from engine.config import AttentionBackendName
from engine.model.attention.backend import (
    AttentionBackend,
    AttentionLayout,
    AttentionMetadata,
    DecodeBuffers,
)
from engine.model.triton_support import triton_installed
from engine.registry import Registry

# Each entry is built for the model's layout; by path, as the triton backend needs triton.
ATTENTION_BACKENDS: Registry[Callable[[AttentionLayout], AttentionBackend]] = Registry(
    "attention backend", {
        "sdpa": "engine.model.attention.sdpa:SdpaBackend",
        "triton": "engine.model.attention.triton_backend:TritonBackend",
        "triton-sdpa": "engine.model.attention.triton_backend:TritonSdpaBackend",
    })

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionLayout",
    "AttentionMetadata",
    "DecodeBuffers",
    "make_attention_backend",
    "resolve_attention_backend",
]


def resolve_attention_backend(name: AttentionBackendName, layout: AttentionLayout) -> str:
    """The backend a name selects for `layout` (`auto`: see the module docstring)."""
    if name == "auto":
        # Only triton reads a cache of another dtype than the model's (fp8): off CUDA, or
        # where triton does not cover the model, sdpa then says so.
        return "triton-sdpa" if _triton_covers(layout) else "sdpa"
    ATTENTION_BACKENDS.check(name)
    return name


def _triton_covers(layout: AttentionLayout) -> bool:
    if layout.device.type != "cuda" or not triton_installed():
        return False
    kernels = importlib.import_module("engine.model.attention.triton_kernels")
    return kernels.supports(layout.head_dim, layout.block_size)


def make_attention_backend(name: AttentionBackendName, layout: AttentionLayout
                           ) -> AttentionBackend:
    """The backend `name` selects, built for `layout`; ValueError when it cannot serve it."""
    return ATTENTION_BACKENDS.load(resolve_attention_backend(name, layout))(layout)
