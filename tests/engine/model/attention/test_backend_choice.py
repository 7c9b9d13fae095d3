"""Which attention backend a name selects: `auto` is triton-sdpa on CUDA where Triton is
installed and its kernels cover the layout, sdpa everywhere else."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.model.attention import resolve_attention_backend
from engine.model.attention.backend import AttentionLayout


def layout(device: str, head_dim: int = 64, block_size: int = 16) -> AttentionLayout:
    return AttentionLayout(num_heads=4, num_kv_heads=2, head_dim=head_dim,
                           block_size=block_size, sliding_window=None,
                           device=torch.device(device), dtype=torch.bfloat16, max_model_len=256)


def test_auto_is_triton_sdpa_on_cuda_where_its_kernels_cover_the_layout() -> None:
    pytest.importorskip("triton")
    assert resolve_attention_backend("auto", layout("cuda")) == "triton-sdpa"
    assert resolve_attention_backend("auto", layout("cuda", head_dim=80)) == "sdpa"
    assert resolve_attention_backend("auto", layout("cuda", block_size=4)) == "sdpa"
    assert resolve_attention_backend("auto", layout("cpu")) == "sdpa"


def test_auto_is_sdpa_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "triton" else find_spec(name, *args))
    assert resolve_attention_backend("auto", layout("cuda")) == "sdpa"


def test_a_named_backend_is_kept_and_an_unknown_one_refused() -> None:
    assert resolve_attention_backend("sdpa", layout("cuda")) == "sdpa"
    assert resolve_attention_backend("triton", layout("cpu")) == "triton"
    assert resolve_attention_backend("triton-sdpa", layout("cuda")) == "triton-sdpa"
    with pytest.raises(ValueError, match="flash"):
        resolve_attention_backend("flash", layout("cpu"))  # type: ignore[arg-type]
