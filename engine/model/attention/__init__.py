"""Attention backends: the seam (`backend.py`) and its implementations, chosen by name.

- `sdpa`: attention in torch (K/V gathered out of the paged cache, then SDPA); every device.
- `triton`: Triton kernels reading K/V in place through the block table; CUDA (or CPU under
  Triton's interpreter, for tests); decode plans over static buffers for CUDA graphs.
- `auto`: `sdpa`. The triton backend becomes `auto`'s choice on CUDA once a GPU run of
  `scripts/gpu_bench.sh` has passed with it; until then it is chosen by name.
"""

from __future__ import annotations

import importlib

from engine.config import AttentionBackendName
from engine.model.attention.backend import (
    AttentionBackend,
    AttentionLayout,
    AttentionMetadata,
    DecodeBuffers,
)

# name -> "module:Class", imported on use (the triton backend needs triton installed).
ATTENTION_BACKENDS = {
    "sdpa": "engine.model.attention.sdpa:SdpaBackend",
    "triton": "engine.model.attention.triton_backend:TritonBackend",
}

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
    """The backend a name selects for `layout`: `auto` is `sdpa` (see the module docstring)."""
    if name == "auto":
        return "sdpa"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of auto, "
                         f"{', '.join(ATTENTION_BACKENDS)}; got {name!r}")
    return name


def make_attention_backend(name: AttentionBackendName, layout: AttentionLayout
                           ) -> AttentionBackend:
    """The backend `name` selects, built for `layout`; ValueError when it cannot serve it."""
    module_name, class_name = ATTENTION_BACKENDS[resolve_attention_backend(name, layout)].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"the {name} attention backend cannot be loaded: {error}") from error
    return getattr(module, class_name)(layout)
