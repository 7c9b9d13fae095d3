"""The decoder's building blocks (`engine.model.layers`): the SwiGLU MLP computes the same
values whether its gate and up projections run as one matmul or two."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.layers import SwiGLUMLP

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _mlp(bias: bool, use_triton: bool, fuse_gate_up: bool, seed: int) -> SwiGLUMLP:
    torch.manual_seed(seed)
    mlp = SwiGLUMLP(48, 80, bias, use_triton=use_triton, fuse_gate_up=fuse_gate_up)
    with torch.no_grad():
        for param in mlp.parameters():
            param.normal_(std=0.2)
    return mlp.to(DEVICE)


def _reference(mlp: SwiGLUMLP, x: torch.Tensor) -> torch.Tensor:
    """The checkpoint's formula on the checkpoint's separate tensors."""
    weight, bias = mlp.gate_up_proj.weight, mlp.gate_up_proj.bias
    gate_w, up_w = weight.chunk(2)
    gate_b, up_b = (None, None) if bias is None else bias.chunk(2)
    return mlp.down_proj(F.silu(F.linear(x, gate_w, gate_b)) * F.linear(x, up_w, up_b))


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_and_separate_gate_up_compute_the_same_values(bias: bool,
                                                            use_triton: bool) -> None:
    if use_triton:
        pytest.importorskip("triton")
    separate = _mlp(bias, use_triton, fuse_gate_up=False, seed=0)
    fused = _mlp(bias, use_triton, fuse_gate_up=True, seed=0)
    x = torch.randn(7, 48, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        expected = _reference(separate, x)
        torch.testing.assert_close(separate(x), expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(fused(x), expected, atol=1e-4, rtol=1e-4)
        assert fused(x[:0]).shape == (0, 48)
