"""Dummy weights drawn in place (`load_format="dummy"`): the same values as a model built whole
and then drawn, FP8 projections quantized a layer at a time, and the sizing that lets
Llama-3.1-70B in FP8 sit on one H200 beside a KV pool.

The 70B's CPU stand-in is `eval/gpu/llama3.1-70b-shrunk.json`: its structure (8 query heads a
KV head, llama3 RoPE scaling, untied embeddings, an MLP 3.5 times the hidden size) at tiny
sizes. The FP8 row kernel runs under Triton's interpreter here (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from engine.config import CacheConfig, ModelConfig
from engine.frontend.llm import LLM
from engine.model.arch import ModelArch
from engine.model.configs import CONFIGS_DIR
from engine.model.fp8_linear import Fp8Linear, quantize_projections
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import check_weights_fit, init_dummy_weights, load_model, weight_bytes
from engine.model.tiny import TINY_MODEL_DIR
from engine.sampling_params import SamplingParams
from engine.worker.kv_cache_sizing import kv_block_bytes, kv_pool_blocks, resolve_kv_cache_dtype
from tests.engine.model.fp8_support import needs_cpu_product

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
REPO = Path(__file__).resolve().parents[3]
SHRUNK_70B = REPO / "eval/gpu/llama3.1-70b-shrunk.json"
GIB = 2**30
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="Triton kernels on CPU tensors")


def _model_dir(tmp_path: Path, config: Path = SHRUNK_70B) -> Path:
    path = tmp_path / config.stem
    path.mkdir()
    shutil.copy(config, path / "config.json")
    return path


def _built_whole(path: Path, seed: int, dtype: torch.dtype, quantized: bool, use_triton: bool,
                 max_positions: int, device: torch.device = CPU) -> LlamaForCausalLM:
    """The model as a checkpoint's is built: whole, in float32, then drawn, converted and
    quantized."""
    arch = ModelArch.from_hf_config(json.loads((path / "config.json").read_text()))
    with torch.device(device):
        model = LlamaForCausalLM(arch, max_positions, use_triton_kernels=use_triton,
                                 fuse_gate_up=quantized or device.type == "cuda")
    init_dummy_weights(model, seed, device)
    model = model.to(dtype=dtype)
    if quantized:
        quantize_projections(model.model.layers, use_triton)
    return model.eval()


def _assert_same_tensors(model: torch.nn.Module, expected: torch.nn.Module) -> None:
    state, expected_state = model.state_dict(), expected.state_dict()
    assert state.keys() == expected_state.keys()
    for name, tensor in expected_state.items():
        assert state[name].dtype == tensor.dtype, name
        # Bytes: float8 values compare as the integers they are stored as.
        assert torch.equal(state[name].view(torch.uint8), tensor.view(torch.uint8)), name
    buffers = dict(model.named_buffers())
    for name, tensor in expected.named_buffers():  # RoPE's table too (not in the state)
        assert torch.equal(buffers[name], tensor), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dummy_weights_drawn_in_place_are_those_of_the_whole_model(
        tmp_path: Path, dtype: torch.dtype) -> None:
    path = _model_dir(tmp_path)
    model = load_model(ModelConfig(model=str(path), load_format="dummy", seed=5), CPU, dtype,
                       128)
    _assert_same_tensors(model, _built_whole(path, 5, dtype, quantized=False, use_triton=False,
                                             max_positions=128))
    assert not model.training


def test_tied_embeddings_are_drawn_once(tmp_path: Path) -> None:
    path = _model_dir(tmp_path, TINY_MODEL_DIR / "config.json")
    model = load_model(ModelConfig(model=str(path), load_format="dummy", seed=2), CPU,
                       torch.float32, 64)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    _assert_same_tensors(model, _built_whole(path, 2, torch.float32, quantized=False,
                                             use_triton=False, max_positions=64))


@pytest.mark.parametrize("device, layer_kernels", [
    pytest.param(CPU, "torch", marks=needs_cpu_product),
    pytest.param(CPU, "triton", marks=(needs_cpu_product, needs_interpreter)),
    pytest.param(torch.device("cuda"), "triton", marks=needs_cuda)])
def test_fp8_dummy_projections_are_quantized_from_the_same_draw(
        tmp_path: Path, device: torch.device, layer_kernels: str) -> None:
    if layer_kernels == "triton":
        pytest.importorskip("triton")
    path = _model_dir(tmp_path)
    config = ModelConfig(model=str(path), load_format="dummy", seed=7, quantization="fp8",
                         layer_kernels=layer_kernels)  # type: ignore[arg-type]
    model = load_model(config, device, torch.bfloat16, 128)
    layers = model.model.layers
    assert all(isinstance(layer.mlp.down_proj, Fp8Linear) for layer in layers)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.lm_head.weight.device.type == device.type
    _assert_same_tensors(model, _built_whole(path, 7, torch.bfloat16, quantized=True,
                                             use_triton=layer_kernels == "triton",
                                             max_positions=128, device=device))


def test_weight_bytes_count_the_projections_as_quantized(tmp_path: Path) -> None:
    path = _model_dir(tmp_path)
    arch = ModelArch.from_hf_config(json.loads((path / "config.json").read_text()))
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, 64, fuse_gate_up=True).to(dtype=torch.bfloat16)
    built = _built_whole(path, 0, torch.bfloat16, quantized=True, use_triton=False,
                         max_positions=64)
    assert weight_bytes(model, quantized=True) == weight_bytes(built, quantized=False)
    assert weight_bytes(model, quantized=False) > weight_bytes(model, quantized=True)
    assert all(t.is_meta for t in model.parameters())  # counted on a copy


def test_llama_70b_in_fp8_leaves_an_h200_room_for_a_kv_pool() -> None:
    """Llama-3.1-70B's own shapes, counted on the meta device: its FP8 weights fit one H200
    (about 139 GiB as torch reports it) with tens of GiB for the KV pool at the default
    `gpu_memory_utilization`; in bfloat16 they do not fit at all."""
    arch = ModelArch.from_hf_config(json.loads((CONFIGS_DIR / "llama3.1-70b.json").read_text()))
    assert (arch.num_hidden_layers, arch.hidden_size, arch.intermediate_size) == (80, 8192, 28672)
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (64, 8, 128)
    assert arch.vocab_size == 128256 and arch.rope_scaling.rope_type == "llama3"
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, 32768, fuse_gate_up=True).to(dtype=torch.bfloat16)
    h200_bytes = 139 * GIB
    usable_bytes = int(h200_bytes * CacheConfig().gpu_memory_utilization)
    fp8_bytes, bf16_bytes = weight_bytes(model, True), weight_bytes(model, False)
    assert 67 * GIB < fp8_bytes < 69 * GIB  # 68.5e9 projection bytes + bf16 head and embeddings
    assert 131 * GIB < bf16_bytes < 132 * GIB
    check_weights_fit(fp8_bytes, h200_bytes - 2 * GIB, "cuda:0")
    with pytest.raises(ValueError, match=r"take 131\.\d GiB and cuda:0 has 80\.0 GiB free"):
        check_weights_fit(bf16_bytes, 80 * GIB, "cuda:0")  # an H100's
    # The pool after the weights and 8 GiB of activations, CUDA graphs and the like.
    block_bytes = {kv: kv_block_bytes(arch, 16, resolve_kv_cache_dtype(kv, torch.bfloat16))
                   for kv in ("auto", "fp8")}
    assert kv_pool_blocks(usable_bytes - bf16_bytes - 8 * GIB, block_bytes["auto"], 0) == 0
    budget = usable_bytes - fp8_bytes - 8 * GIB
    assert kv_pool_blocks(budget, block_bytes["auto"], 0) * 16 > 150_000
    assert kv_pool_blocks(budget, block_bytes["fp8"], 0) * 16 > 300_000


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_a_shrunken_70b_generates_with_fp8_projections_and_kv_cache(
        tmp_path: Path, device: str) -> None:
    path = _model_dir(tmp_path)
    llm = LLM(str(path), load_format="dummy", tokenizer=str(TINY_MODEL_DIR), device=device,
              quantization="fp8", kv_cache_dtype="fp8", attention_backend="triton",
              num_kv_blocks=32, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (first,) = llm.generate([list(range(3, 40))], params, use_tqdm=False)
    (again,) = llm.generate([list(range(3, 40))], params, use_tqdm=False)  # from the cache
    assert len(first.outputs[0].token_ids) == 6
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
