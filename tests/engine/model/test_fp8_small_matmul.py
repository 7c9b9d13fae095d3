"""`fp8_small_matmul`: a few rows times float8 weights widened in registers, against float32
sums of the same values (under Triton's interpreter here; on a GPU, on the device)."""

from __future__ import annotations

import pytest
import torch

from engine.model.fp8_linear import Fp8Linear, quantize_rows
from engine.model.fp8_small_matmul import (
    DEFAULT_TILE,
    MAX_ROWS,
    SmallMatmulTile,
    fp8_small_matmul,
    split_k,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _quantized(out_features: int, in_features: int, seed: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    values, scales = quantize_rows(weight, use_triton=False)
    return values.to(DEVICE), scales.reshape(1, out_features).to(DEVICE)


def _exact(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.float() @ (weight.float() * scale.t()).t()


# Rows at 1, across the dot's 16 and at the most; reductions within one tile, across tiles,
# split (a 2,048 reduction over 64 outputs splits 4 ways) and ragged at a tile's end; outputs
# not a multiple of the tile.
@pytest.mark.parametrize(("rows", "in_features", "out_features"), [
    (1, 128, 64), (17, 400, 96), (MAX_ROWS, 256, 80), (3, 2048, 64), (5, 1040, 48)])
def test_the_product_matches_float32_sums_of_the_dequantized_weights(
        rows: int, in_features: int, out_features: int) -> None:
    weight, scale = _quantized(out_features, in_features, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    out = fp8_small_matmul(x, weight, scale)
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    torch.testing.assert_close(out, _exact(x, weight, scale), atol=1e-4, rtol=1e-4)


def test_bfloat16_rows_give_bfloat16_within_its_rounding() -> None:
    weight, scale = _quantized(64, 2048, seed=3)  # split 4 ways: partials summed in float32
    x = torch.randn(4, 2048, generator=torch.Generator().manual_seed(8)).to(DEVICE,
                                                                            torch.bfloat16)
    out = fp8_small_matmul(x, weight, scale)
    exact = _exact(x, weight, scale)
    assert out.dtype == torch.bfloat16
    # One rounding to bfloat16 (8 bits: 2^-8 of a value), toward zero under the interpreter.
    assert ((out.float() - exact).abs() <= exact.abs() * 2 ** -7 + 1e-3).all()


def test_splits_fill_the_card_but_never_split_a_short_reduction() -> None:
    assert split_k(4096, 4096, DEFAULT_TILE) == 4  # 64 column tiles: 4 x 64 of 264
    assert split_k(28672, 4096, DEFAULT_TILE) == 1  # 448 column tiles fill it alone
    assert split_k(4096, 14336, DEFAULT_TILE) == 4
    assert split_k(64, 256, DEFAULT_TILE) == 1  # under 512 positions a split
    assert split_k(64, 1024, SmallMatmulTile(64, 128, 4, 4)) == 2


def test_bad_inputs_are_refused() -> None:
    weight, scale = _quantized(64, 128, seed=1)
    with pytest.raises(ValueError, match="at most"):
        fp8_small_matmul(torch.zeros(MAX_ROWS + 1, 128, device=DEVICE), weight, scale)
    with pytest.raises(ValueError, match="does not match"):
        fp8_small_matmul(torch.zeros(2, 96, device=DEVICE), weight, scale)
    with pytest.raises(ValueError, match="contiguous rows"):
        fp8_small_matmul(torch.zeros(128, 2, device=DEVICE).t(), weight, scale)
    assert fp8_small_matmul(torch.zeros(0, 128, device=DEVICE), weight, scale).shape == (0, 64)


def test_fp8_linear_takes_it_for_small_products_only(monkeypatch: pytest.MonkeyPatch) -> None:
    linear = torch.nn.Linear(128, 48, bias=True).to(DEVICE)
    quantized = Fp8Linear.quantize(linear, use_triton=True, small_matmul_max_rows=8)
    scaled_mm_rows: list[int] = []
    scaled_mm = torch._scaled_mm

    def spy(values: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        scaled_mm_rows.append(values.shape[0])
        return scaled_mm(values, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    x = torch.randn(2, 4, 128, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    with torch.no_grad():
        small = quantized(x)  # 8 rows: the kernel, rows unquantized
        large = quantized(torch.cat([x, x]))  # 16 rows: `_scaled_mm`
    exact = _exact(x.reshape(8, 128), quantized.weight, quantized.weight_scale) + linear.bias
    torch.testing.assert_close(small.reshape(8, 48), exact, atol=1e-4, rtol=1e-4)
    assert scaled_mm_rows == [16] and large.shape == (4, 4, 48)


def test_the_small_product_needs_the_layer_kernels_and_at_most_its_rows() -> None:
    linear = torch.nn.Linear(32, 16, bias=False)
    assert Fp8Linear.quantize(linear, use_triton=False, small_matmul_max_rows=8
                              ).small_matmul_max_rows == 0
    with pytest.raises(ValueError, match="small_matmul_max_rows"):
        Fp8Linear.quantize(linear, use_triton=True, small_matmul_max_rows=MAX_ROWS + 1)
