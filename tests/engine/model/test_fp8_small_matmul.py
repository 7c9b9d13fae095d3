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


# Row-dtype tolerances: float32 sums either way; a 16-bit output rounds once (to 2^-8 or 2^-11
# of a value, toward zero under the interpreter).
_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}


# Rows at 1, across the dot's 16 and at the most (64: Hopper's warp-group product); reductions
# within one tile, across tiles, split (2,048 over 64 outputs: 4 ways; over 208: 4 column
# tiles, the last partial, each split 4 ways) and ragged at a tile's end (1,040; 4,112: whole
# tiles a split would leave the last splits empty); outputs not a multiple of the tile.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "in_features", "out_features"), [
    (1, 128, 64), (17, 400, 96), (MAX_ROWS, 256, 80), (3, 2048, 64), (5, 1040, 48),
    (MAX_ROWS, 2048, 208), (2, 4112, 64)])
def test_the_product_matches_float32_sums_of_the_dequantized_weights(
        rows: int, in_features: int, out_features: int, dtype: torch.dtype) -> None:
    weight, scale = _quantized(out_features, in_features, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(7)).to(DEVICE,
                                                                                      dtype)
    out = fp8_small_matmul(x, weight, scale)
    exact = _exact(x, weight, scale)
    assert out.shape == (rows, out_features) and out.dtype == dtype
    assert ((out.float() - exact).abs() <= exact.abs() * _TOLERANCE[dtype] + 1e-4).all()


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
    with pytest.raises(ValueError, match="float8 e4m3"):
        fp8_small_matmul(torch.zeros(2, 128, device=DEVICE), weight.float(), scale)
    with pytest.raises(ValueError, match="float8 e4m3"):
        fp8_small_matmul(torch.zeros(2, 128, dtype=torch.int32, device=DEVICE), weight, scale)
    with pytest.raises(ValueError, match="float32 values"):
        fp8_small_matmul(torch.zeros(2, 128, device=DEVICE), weight, scale.double())
    assert fp8_small_matmul(torch.zeros(0, 128, device=DEVICE), weight, scale).shape == (0, 64)


def test_fp8_linear_takes_it_for_small_products_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # bfloat16 on CUDA, as the engine runs FP8 projections there (float32 on this CPU).
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    linear = torch.nn.Linear(128, 48, bias=True).to(DEVICE, dtype)
    quantized = Fp8Linear.quantize(linear, use_triton=True, small_matmul_max_rows=8)
    scaled_mm_rows: list[int] = []
    scaled_mm = torch._scaled_mm

    def spy(values: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        scaled_mm_rows.append(values.shape[0])
        return scaled_mm(values, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    x = torch.randn(2, 4, 128, generator=torch.Generator().manual_seed(9)).to(DEVICE, dtype)
    with torch.no_grad():
        small = quantized(x)  # 8 rows: the kernel, rows unquantized
        large = quantized(torch.cat([x, x]))  # 16 rows: `_scaled_mm`
    exact = (_exact(x.reshape(8, 128), quantized.weight, quantized.weight_scale)
             + linear.bias.float())
    # The bias adds in the output's dtype: a second rounding on CUDA.
    tolerance = 2 * _TOLERANCE[dtype]
    assert ((small.reshape(8, 48).float() - exact).abs()
            <= exact.abs() * tolerance + 1e-3).all()
    assert scaled_mm_rows == [16] and large.shape == (4, 4, 48)


def test_the_small_product_needs_the_layer_kernels_and_at_most_its_rows() -> None:
    linear = torch.nn.Linear(32, 16, bias=False).to(DEVICE)
    assert Fp8Linear.quantize(linear, use_triton=False, small_matmul_max_rows=8
                              ).small_matmul_max_rows == 0
    assert Fp8Linear.quantize(linear, use_triton=True).small_matmul_max_rows == 0  # off
    for bad in (MAX_ROWS + 1, -1):
        with pytest.raises(ValueError, match="small_matmul_max_rows"):
            Fp8Linear.quantize(linear, use_triton=True, small_matmul_max_rows=bad)
        with pytest.raises(ValueError, match="small_matmul_max_rows"):
            Fp8Linear.quantize(linear, use_triton=False, small_matmul_max_rows=bad)
