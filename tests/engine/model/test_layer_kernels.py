"""The fused layer kernels against the torch code they replace (`engine.model.layers`,
`engine.model.rope`), under Triton's interpreter without a GPU: small shapes, each dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from engine.model.arch import RopeScaling
from engine.model.layer_kernels import rms_norm, rotary_, silu_and_mul
from engine.model.layers import RMSNorm
from engine.model.rope import RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# A few roundings of each dtype: torch rounds after each op where the kernels round once, and
# the interpreter rounds its casts down to 16 bits toward zero (compiled kernels: to nearest).
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tolerance = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_a_residual_matches_torch(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    size = 96  # not a power of two: the kernel masks the padded columns
    norm = RMSNorm(size, 1e-5).to(DEVICE, dtype)
    norm.weight.data = torch.randn(size, generator=generator).to(DEVICE, dtype)
    wide = torch.randn(5, 2 * size, generator=generator).to(DEVICE, dtype)
    x = wide[:, :size]  # strided rows, as a slice of a larger activation
    residual = torch.randn(5, size, generator=generator).to(DEVICE, dtype)

    out, summed = rms_norm(x, norm.weight, norm.eps)
    assert summed is x
    _close(out, norm(x))

    out, summed = rms_norm(x, norm.weight, norm.eps, residual)
    expected_sum = x + residual
    _close(summed, expected_sum)
    _close(out, norm(expected_sum))
    assert out.dtype == dtype and not torch.equal(residual, summed)


def test_rms_norm_of_no_rows_and_bad_inputs() -> None:
    weight = torch.ones(8, device=DEVICE)
    out, summed = rms_norm(torch.empty(0, 8, device=DEVICE), weight, 1e-6)
    assert out.shape == (0, 8) and summed.shape == (0, 8)
    with pytest.raises(ValueError, match="contiguous rows"):
        rms_norm(torch.ones(8, 2, device=DEVICE).t(), weight, 1e-6)
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm(torch.ones(2, 8, device=DEVICE), torch.ones(4, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="does not match"):
        rms_norm(torch.ones(2, 8, device=DEVICE), weight, 1e-6, torch.ones(3, 8, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 1, 16), (6, 2, 32)])
def test_rotary_in_place_matches_torch_on_views_of_a_fused_projection(
        dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    generator = torch.Generator().manual_seed(1)
    rotary = RotaryEmbedding(head_dim, 64, 500000.0, RopeScaling()).to(DEVICE)
    tokens = 7
    sizes = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
    qkv = torch.randn(tokens, sum(sizes), generator=generator).to(DEVICE, dtype)
    positions = torch.tensor([0, 1, 5, 63, 9, 9, 30], device=DEVICE)
    query, key, value = qkv.split(sizes, dim=-1)
    query = query.view(tokens, num_heads, head_dim)
    key = key.view(tokens, num_kv_heads, head_dim)
    expected_query, expected_key = RotaryEmbedding.apply(
        rotary.cos_sin(positions, dtype), query.clone(), key.clone())
    value_before = value.clone()

    rotary_(query, key, positions, rotary.table)

    _close(query, expected_query)
    _close(key, expected_key)
    assert torch.equal(value, value_before)  # the rest of the projection is untouched


def test_rotary_rejects_mismatched_inputs() -> None:
    table = torch.zeros(8, 16, device=DEVICE)
    query = torch.zeros(2, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="does not match query"):
        rotary_(query, torch.zeros(3, 1, 16, device=DEVICE), torch.zeros(2, dtype=torch.int64,
                                                                         device=DEVICE), table)
    with pytest.raises(ValueError, match="positions"):
        rotary_(query, torch.zeros(2, 1, 16, device=DEVICE),
                torch.zeros(3, dtype=torch.int64, device=DEVICE), table)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(2)
    gate = (4 * torch.randn(3, 700, generator=generator)).to(DEVICE, dtype)
    up = torch.randn(3, 700, generator=generator).to(DEVICE, dtype)
    _close(silu_and_mul(gate, up), F.silu(gate) * up)
    with pytest.raises(ValueError, match="differ"):
        silu_and_mul(gate, up[:, :10])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_reads_the_halves_of_a_fused_product(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    gate_up = (4 * torch.randn(5, 2 * 1500, generator=generator)).to(DEVICE, dtype)
    gate, up = gate_up[:, :1500], gate_up[:, 1500:]
    out = silu_and_mul(gate, up)
    assert out.is_contiguous()
    _close(out, F.silu(gate) * up)
    with pytest.raises(ValueError, match="contiguous rows"):
        silu_and_mul(gate.t(), up.t())
