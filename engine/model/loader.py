"""Builds a model from a `ModelConfig`: resolves the directory, dtype and device, loads weights.

`model="tiny"` is the embedded default model (files in `engine/model/tiny/`, weights drawn from
`ModelConfig.seed` on the CPU, so every device gets the same ones). Any other name is a local
Hugging Face directory holding `config.json` and safetensors weights (one file, several, or a
sharded `model.safetensors.index.json`). `load_format="dummy"` draws random weights from the
seed instead of reading any, on the target device (drawing billions of values on the CPU takes
minutes), so they are reproducible per device, not across devices.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch

from engine.config import LayerKernelsName, ModelConfig
from engine.model.directory import TINY_MODEL_NAME, load_arch, resolve_model_dir
from engine.model.fp8_linear import check_fp8_supported, quantize_projections
from engine.model.llama import LlamaForCausalLM
from engine.model.triton_support import check_triton_runs_on, triton_installed

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DUMMY_INIT_STD = 0.02


def resolve_device(device: str) -> torch.device:
    """`auto` is CUDA when available, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA device is available")
    return torch.device(device)


def resolve_layer_kernels(name: LayerKernelsName, device: torch.device
                          ) -> Literal["torch", "triton"]:
    """`auto` is triton on CUDA when Triton is installed, else torch. ValueError when triton
    cannot run: not installed, or on CPU outside Triton's interpreter (`TRITON_INTERPRET=1`)."""
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_installed() else "torch"
    if name == "triton":
        check_triton_runs_on(device, "layer_kernels 'triton'")
    return name


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto` is float32 on CPU and bfloat16 on CUDA."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def load_model(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, max_positions: int
) -> LlamaForCausalLM:
    """The model in eval mode on `device`, weights loaded; RoPE covers `max_positions`."""
    arch = load_arch(config.model)
    if max_positions > arch.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_positions} exceeds the model's max_position_embeddings "
            f"{arch.max_position_embeddings}"
        )
    use_triton = resolve_layer_kernels(config.layer_kernels, device) == "triton"
    quantized = config.quantization == "fp8"
    if quantized:
        check_fp8_supported(device, dtype)  # before building or loading anything
    with torch.device(device):
        # An FP8 projection multiplies whole: gate and up are then one product on CPU too.
        model = LlamaForCausalLM(arch, max_positions, use_triton_kernels=use_triton,
                                 fuse_gate_up=device.type == "cuda" or quantized)
    if config.model == TINY_MODEL_NAME:
        init_dummy_weights(model, config.seed, torch.device("cpu"))
    elif config.load_format == "dummy":
        # Converted first, so the draw fills the target dtype (half the bytes in bfloat16).
        model.to(dtype=dtype)
        init_dummy_weights(model, config.seed, device)
    else:
        model.load_weights(iterate_safetensors(resolve_model_dir(config.model)))
    model = model.to(dtype=dtype).eval()
    if quantized:
        quantize_projections(model.model.layers, use_triton)
    if device.type == "cuda":
        # The float32 weights of construction stay cached otherwise, and the KV sizing counts
        # cached memory as used.
        torch.cuda.empty_cache()
    return model


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int, draw_device: torch.device) -> None:
    """Deterministic random weights: matrices ~ N(0, 0.02), norms 1, biases 0.

    Each matrix is drawn in float32 on `draw_device` from one generator seeded with `seed`,
    in parameter order, then copied into the parameter (rounded to its dtype, moved to its
    device): the same seed and draw device give the same weights whatever the parameters'
    device and dtype.
    """
    generator = torch.Generator(device=draw_device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            values = torch.randn(param.shape, generator=generator, device=draw_device)
            param.copy_(values.mul_(_DUMMY_INIT_STD))


def iterate_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of every safetensors file the checkpoint names."""
    from safetensors import safe_open

    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"no safetensors weights in {model_dir}; use --load-format dummy for random weights"
        )
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, handle.get_tensor(name)
