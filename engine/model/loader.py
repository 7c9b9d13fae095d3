"""Builds a model from a `ModelConfig`: resolves the directory, dtype and device, loads weights.

`model="tiny"` is the embedded default model (files in `engine/model/tiny/`, weights drawn from
`ModelConfig.seed` on the CPU, so every device gets the same ones). Any other name is a local
Hugging Face directory holding `config.json` and safetensors weights (one file, several, or a
sharded `model.safetensors.index.json`). `load_format="dummy"` draws random weights from the
seed instead of reading any, on the target device (drawing billions of values on the CPU takes
minutes), so they are reproducible per device, not across devices. A dummy model is built
without storage first and each tensor is drawn in place, a decoder layer at a time: with FP8
projections each layer is quantized as soon as it is drawn, so the model never exists in 16
bits (Llama-3.1-70B takes 141 GB in bfloat16, 73 GB with FP8 projections).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch

from engine.config import LayerKernelsName, ModelConfig
from engine.model.directory import TINY_MODEL_NAME, load_arch, resolve_model_dir
from engine.model.fp8_linear import check_fp8_supported, quantize_projections
from engine.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.model.rope import RotaryEmbedding
from engine.model.triton_support import check_triton_runs_on, triton_installed

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DUMMY_INIT_STD = 0.02
_GIB = 2**30


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
    """The model in eval mode on `device`, weights loaded; RoPE covers `max_positions`.
    ValueError before anything is allocated on a GPU whose free memory cannot hold a dummy
    model's weights."""
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
    # An FP8 projection multiplies whole: gate and up are then one product on CPU too.
    fuse_gate_up = device.type == "cuda" or quantized
    if config.model != TINY_MODEL_NAME and config.load_format == "dummy":
        with torch.device("meta"):
            model = LlamaForCausalLM(arch, max_positions, use_triton_kernels=use_triton,
                                     fuse_gate_up=fuse_gate_up)
        model.to(dtype=dtype)
        if device.type == "cuda":
            check_weights_fit(weight_bytes(model, quantized), torch.cuda.mem_get_info(device)[0],
                              str(device))
        draw_dummy_model(model, config.seed, device, quantized, use_triton)
    else:
        with torch.device(device):
            model = LlamaForCausalLM(arch, max_positions, use_triton_kernels=use_triton,
                                     fuse_gate_up=fuse_gate_up)
        if config.model == TINY_MODEL_NAME:
            init_dummy_weights(model, config.seed, torch.device("cpu"))
        else:
            model.load_weights(iterate_safetensors(resolve_model_dir(config.model)))
        model = model.to(dtype=dtype)
        if quantized:
            quantize_projections(model.model.layers, use_triton)
    model.eval()
    if device.type == "cuda":
        # The float32 weights of construction, or the draws' temporaries, stay cached
        # otherwise, and the KV sizing counts cached memory as used.
        torch.cuda.empty_cache()
    return model


def weight_bytes(model: LlamaForCausalLM, quantized: bool) -> int:
    """Bytes the model's parameters and buffers take (a tied tensor once), its projections
    counted as `quantize_projections` leaves them when `quantized`. Works on a model without
    storage (built on the meta device), whose tensors have their final dtypes."""
    if quantized:
        model = copy.deepcopy(model)  # without storage: only the shapes are copied
        quantize_projections(model.model.layers, use_triton=False)
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def check_weights_fit(weight_bytes: int, free_bytes: int, device_name: str) -> None:
    """ValueError when weights of `weight_bytes` cannot fit in the `free_bytes` of the device,
    so that a model too large fails before its first allocation rather than midway."""
    if weight_bytes > free_bytes:
        raise ValueError(
            f"the model's weights take {weight_bytes / _GIB:.1f} GiB and {device_name} has "
            f"{free_bytes / _GIB:.1f} GiB free (quantization 'fp8' stores the projections in "
            "half the bytes)")


@torch.no_grad()
def draw_dummy_model(model: LlamaForCausalLM, seed: int, device: torch.device, quantized: bool,
                     use_triton: bool) -> None:
    """Fills a model built on the meta device with `init_dummy_weights`'s values on `device`
    (the same ones, from the same generator in the same order), in the dtypes its tensors
    have; with `quantized`, each decoder layer's projections are quantized as soon as the
    layer is drawn, so the peak is the finished layers plus one layer in 16 bits. RoPE's
    table is computed anew on `device`."""
    generator = torch.Generator(device=device).manual_seed(seed)
    _draw_module(model, "", generator, device, quantized, use_triton, {})
    old_rotary = model.model.rotary
    with torch.device(device):
        rotary = RotaryEmbedding(model.arch.head_dim, old_rotary.table.shape[0],
                                 model.arch.rope_theta, model.arch.rope_scaling,
                                 old_rotary.use_triton)
    model.model.rotary = rotary.to(dtype=old_rotary.table.dtype)
    left = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left without storage after the dummy draw: {left[:4]}")


def _draw_module(module: torch.nn.Module, prefix: str, generator: torch.Generator,
                 device: torch.device, quantized: bool, use_triton: bool,
                 drawn: dict[int, torch.nn.Parameter]) -> None:
    """`module`'s own parameters, then its children's, depth first: the order of
    `named_parameters`. A parameter met again (tied) gets the tensor drawn the first time."""
    for name, param in list(module.named_parameters(recurse=False)):
        if id(param) not in drawn:
            value = _dummy_value(prefix + name, param.shape, generator, device)
            drawn[id(param)] = torch.nn.Parameter(value.to(param.dtype),
                                                  requires_grad=param.requires_grad)
        setattr(module, name, drawn[id(param)])
    for name, child in module.named_children():
        _draw_module(child, f"{prefix}{name}.", generator, device, quantized, use_triton, drawn)
    if quantized and isinstance(module, LlamaDecoderLayer):
        quantize_projections(torch.nn.ModuleList([module]), use_triton)


def _dummy_value(name: str, shape: torch.Size, generator: torch.Generator,
                 device: torch.device) -> torch.Tensor:
    """A float32 dummy tensor: norms 1, biases 0, any other N(0, 0.02) from `generator`."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device)
    if name.endswith(".bias"):
        return torch.zeros(shape, device=device)
    return torch.randn(shape, generator=generator, device=device).mul_(_DUMMY_INIT_STD)


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
        param.copy_(_dummy_value(name, param.shape, generator, draw_device))


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
