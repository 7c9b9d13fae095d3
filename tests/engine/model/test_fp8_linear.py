"""FP8 projections (`quantization="fp8"`) on this CPU: torch's `_scaled_mm` has a CPU kernel,
and the row quantization kernel runs under Triton's interpreter (on a GPU, on the device).

On a GPU machine the CPU product's tests skip where torch's CPU kernel cannot multiply with
rowwise scales: they failed on the GPU image's torch 2.11 (`scripts/gpu_bench.sh --part
smoke`, 2026-11-28), whose CUDA product the `..._on_cuda` tests check. Without a GPU they
always run."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch import nn

from engine.config import ModelConfig
from engine.frontend.llm import LLM
from engine.model.attention import AttentionLayout, make_attention_backend
from engine.model.fp8_linear import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Linear,
    check_fp8_supported,
    fp8_refusal,
    quantize_rows,
)
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import load_model
from engine.sampling_params import SamplingParams
from tests.engine.model.fp8_support import cpu_scaled_mm_runs, needs_cpu_product

CPU = torch.device("cpu")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


# Triton's kernels read CPU tensors only under its interpreter (tests/conftest.py sets it
# where there is no GPU).
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="Triton kernels on CPU tensors")


def _random_rows(rows: int, size: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rows * size)
    x = torch.randn(rows, size, generator=generator) * 3
    x[1] = 0.0  # a row of zeros: scale MIN_SCALE, values 0, no NaN
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_quantization_kernel_computes_the_torch_values(dtype: torch.dtype) -> None:
    pytest.importorskip("triton")
    x = _random_rows(5, 96, dtype).to(DEVICE)  # 96: not a power of two, the kernel masks
    values, scales = quantize_rows(x, use_triton=True)
    expected_values, expected_scales = quantize_rows(x, use_triton=False)
    assert values.dtype == FP8_DTYPE and scales.shape == (5, 1)
    assert torch.equal(scales, expected_scales)
    assert torch.equal(values.view(torch.uint8), expected_values.view(torch.uint8))
    values, scales, x = values.cpu(), scales.cpu(), x.cpu()
    assert torch.equal(values[1].float(), torch.zeros(96))
    # each row's largest magnitude maps to e4m3's largest value; the rest round within it
    assert torch.allclose(values.float().abs().amax(dim=1)[[0, 2, 3, 4]],
                          torch.full((4,), FP8_MAX))
    torch.testing.assert_close((values.float() * scales), x.float(), atol=0.0, rtol=0.07)


def _linear(in_features: int, out_features: int, bias: bool, seed: int = 0) -> nn.Linear:
    generator = torch.Generator().manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=generator) * 0.05)
        if bias:
            linear.bias.copy_(torch.randn(out_features, generator=generator) * 0.1)
    return linear


def _dequantized_product(quantized: Fp8Linear, x: torch.Tensor, use_triton: bool
                         ) -> torch.Tensor:
    """`x` times the quantized weight as float32 sums of the float8 values times their scales
    (no bias)."""
    values, scales = quantize_rows(x, use_triton)
    return (values.float() * scales) @ (quantized.weight.float() * quantized.weight_scale.t()).t()


@needs_cpu_product
@pytest.mark.parametrize("rows", [1, 7])
def test_fp8_linear_computes_the_dequantized_product(rows: int) -> None:
    linear = _linear(64, 48, bias=True)
    quantized = Fp8Linear.quantize(linear, use_triton=False)
    assert quantized.weight.dtype == FP8_DTYPE and quantized.weight_scale.shape == (1, 48)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        out = quantized(x)
    exact = _dequantized_product(quantized, x, use_triton=False) + linear.bias
    torch.testing.assert_close(out, exact, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # leading dimensions are kept
        assert quantized(x.reshape(1, rows, 64)).shape == (1, rows, 48)


def test_fp8_linear_asks_for_the_tensor_cores_fast_accumulation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The CPU kernel ignores the flag, so only the call can show it is passed.
    calls: list[dict[str, object]] = []

    def scaled_mm(values: torch.Tensor, weight: torch.Tensor, **kwargs: object) -> torch.Tensor:
        calls.append(kwargs)
        return torch.zeros(values.shape[0], weight.shape[1], dtype=torch.float32)

    quantized = Fp8Linear.quantize(_linear(32, 16, bias=False), use_triton=False)
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    with torch.no_grad():
        assert quantized(torch.ones(3, 32)).shape == (3, 16)
    assert [call["use_fast_accum"] for call in calls] == [True]


@needs_cpu_product
def test_fp8_linear_without_bias_is_within_fp8_error_of_the_linear() -> None:
    linear = _linear(256, 64, bias=False, seed=1)
    quantized = Fp8Linear.quantize(linear, use_triton=False)
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, out = linear(x), quantized(x)
    error = ((out - expected).abs().max() / expected.abs().max()).item()
    assert 0 < error < 0.05, error  # 3 mantissa bits a value, averaged over 256 products


def test_fp8_linear_refuses_sizes_that_scaled_mm_cannot_take() -> None:
    with pytest.raises(ValueError, match="multiples of 16"):
        Fp8Linear.quantize(nn.Linear(40, 48), use_triton=False)


def test_devices_and_dtypes_fp8_refuses() -> None:
    assert fp8_refusal("cpu", torch.float32, None, "cpu") is None
    assert fp8_refusal("cuda", torch.bfloat16, (9, 0), "NVIDIA H100") is None
    assert "dtype bfloat16" in fp8_refusal("cuda", torch.float16, (9, 0), "NVIDIA H100")
    assert "FP8 tensor cores" in fp8_refusal("cuda", torch.bfloat16, (8, 0), "NVIDIA A100")


def test_the_cpu_is_checked_by_a_small_product() -> None:
    if not torch.cuda.is_available() or cpu_scaled_mm_runs():
        check_fp8_supported(CPU, torch.float32)
    else:
        with pytest.raises(ValueError, match="does not run on cpu"):
            check_fp8_supported(CPU, torch.float32)


def _logits(model: LlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:
    arch = model.arch
    layout = AttentionLayout.of_model(arch, 16, CPU, torch.float32, 256)
    num_blocks = -(-len(token_ids) // 16)
    metadata = make_attention_backend("sdpa", layout).build_metadata(
        np.array([len(token_ids)]), np.array([0]), np.arange(num_blocks)[None])
    kv_caches = [torch.zeros(2, (num_blocks + 1) * 16, arch.num_key_value_heads, arch.head_dim)
                 for _ in range(arch.num_hidden_layers)]
    with torch.inference_mode():
        hidden = model(torch.tensor(token_ids), torch.from_numpy(metadata.positions),
                       kv_caches, metadata)
        return model.compute_logits(hidden)


@needs_cpu_product
@pytest.mark.parametrize("layer_kernels", [
    "torch", pytest.param("triton", marks=needs_interpreter)])
def test_quantized_tiny_model_is_close_to_the_model(layer_kernels: str) -> None:
    if layer_kernels == "triton":
        pytest.importorskip("triton")
    # The reference runs torch's layer ops: under the interpreter the fused kernels cost a
    # program a token, and in float32 they compute what torch's do (test_layer_kernels.py).
    model = load_model(ModelConfig(layer_kernels="torch"), CPU, torch.float32, 256)
    quantized = load_model(ModelConfig(layer_kernels=layer_kernels, quantization="fp8"), CPU,
                           torch.float32, 256)
    layer = quantized.model.layers[0]
    projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                   layer.mlp.down_proj)
    assert all(isinstance(p, Fp8Linear) and p.weight.element_size() == 1 for p in projections)
    assert quantized.lm_head.weight.dtype == torch.float32  # the head and embeddings are kept
    token_ids = list(range(3, 43))
    expected, logits = _logits(model, token_ids), _logits(quantized, token_ids)
    # 3.3 % of the logits' range and 38 of 40 argmaxes here; every weight scale 8 % high
    # gives 9.3 % and 35, 8 % low 11.3 % and 32
    spread = (expected.max() - expected.min()).item()
    assert (logits - expected).abs().max().item() < 0.06 * spread
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.9


def test_an_engine_with_fp8_projections_generates() -> None:
    llm = LLM(quantization="fp8", num_kv_blocks=64, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (first,) = llm.generate(["fp8 weights"], params, use_tqdm=False)
    (again,) = llm.generate(["fp8 weights"], params, use_tqdm=False)  # a prefix-cache hit
    assert len(first.outputs[0].token_ids) == 8
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_fp8_linear_on_cuda_computes_the_dequantized_product(rows: int) -> None:
    cuda = torch.device("cuda")
    check_fp8_supported(cuda, torch.bfloat16)
    linear = _linear(128, 96, bias=True).to(cuda, torch.bfloat16)  # a biased projection
    for use_triton in (False, True):
        quantized = Fp8Linear.quantize(linear, use_triton)
        x = torch.randn(rows, 128, device=cuda, dtype=torch.bfloat16)
        with torch.no_grad():
            out = quantized(x)
        exact = _dequantized_product(quantized, x, use_triton) + linear.bias.float()
        torch.testing.assert_close(out.float(), exact, atol=2e-2, rtol=2e-2)  # bf16 output


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("in_features", [4096, 14336])
def test_fast_accumulation_on_cuda_stays_near_the_exact_product(in_features: int) -> None:
    # Llama-3.1-8B's reductions (hidden 4,096; the MLP's 14,336): the tensor cores' fast
    # accumulation against float32 sums of the same float8 values and scales. A weight scale
    # 8 % off would miss by several percent of the largest output.
    cuda = torch.device("cuda")
    check_fp8_supported(cuda, torch.bfloat16)
    linear = _linear(in_features, 256, bias=False).to(cuda, torch.bfloat16)
    quantized = Fp8Linear.quantize(linear, use_triton=True)
    x = torch.randn(64, in_features, device=cuda, dtype=torch.bfloat16)
    with torch.no_grad():
        out = quantized(x).float()
    exact = _dequantized_product(quantized, x, use_triton=True)
    assert (out - exact).abs().max() <= 0.02 * exact.abs().max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_engine_with_fp8_projections_generates_on_cuda() -> None:
    # Decode steps replay CUDA graphs captured with the FP8 products in them.
    llm = LLM(quantization="fp8", device="cuda", num_kv_blocks=64, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (first,) = llm.generate(["fp8 weights"], params, use_tqdm=False)
    (again,) = llm.generate(["fp8 weights"], params, use_tqdm=False)
    assert len(first.outputs[0].token_ids) == 8
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
