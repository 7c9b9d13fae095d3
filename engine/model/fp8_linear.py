"""FP8 projections (`ModelConfig.quantization="fp8"`): weights in float8 e4m3 with a scale per
output channel, inputs quantized per token at each call, multiplied by `torch._scaled_mm`.

The decoder layers' four projections (`qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`)
are quantized once, after the weights are loaded (`quantize_projections`): a checkpoint's
weights, or dummy ones, are rounded to float8 and their bf16 copies freed. That halves the
bytes a decode step reads for them, and on a GPU with FP8 tensor cores (compute capability
8.9 and later: Ada, Hopper) the products run at twice the bf16 rate. The embeddings, the norms
and the LM head keep the model's dtype.

Scales are "rowwise": weight row `n` is divided by `max|W[n, :]| / 448` (448 is e4m3's
largest value) and each input row by its own `max|x[m, :]| / 448`, so that `y = x W^T` is
`(x_q W_q^T) * s_x[m] * s_w[n]`, multiplied by `_scaled_mm`. This is the "fp8 dynamic, per
channel" scheme of vLLM and FBGEMM. Each value keeps 3 mantissa bits: on random weights a
projection's output differs from the bf16 one by a few percent of its largest value. Quality
on real checkpoints is not evaluated here.

The product uses the FP8 tensor cores' fast accumulation (`use_fast_accum=True`): on Hopper
the running sums then stay in the tensor cores' own narrower accumulators rather than being
promoted to float32 as they go. vLLM's CUTLASS FP8 kernels for Hopper accumulate that way,
and torch's rowwise kernel is reported much slower without it; its error is one more term
beside the rounding of values to 3 mantissa bits (`eval/gpu/fp8_gemms.py` measures both the
time and the difference on a GPU). CPU kernels ignore the flag.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.layers import layer_kernels

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
# A row of zeros gets this scale (its values are then all zero), not a division by zero.
MIN_SCALE = 1e-12
# `_scaled_mm` on CUDA needs both dimensions of the weight divisible by 16.
_DIM_MULTIPLE = 16
# Which projections of a decoder layer are quantized: (submodule, attribute).
_PROJECTIONS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"),
                ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


def fp8_refusal(device_type: str, dtype: torch.dtype, capability: tuple[int, int] | None,
                device_name: str) -> str | None:
    """Why FP8 projections cannot run on this device with activations of `dtype` (None: they
    can). On CUDA, `_scaled_mm` with rowwise scales needs bfloat16 output and FP8 tensor
    cores (`capability`, compute capability 8.9 and later); its CPU kernel takes any float
    dtype."""
    if device_type != "cuda":
        return None
    if dtype != torch.bfloat16:
        return f"quantization 'fp8' on CUDA needs dtype bfloat16, not {dtype}"
    if capability is None or capability < (8, 9):
        return (f"quantization 'fp8' needs FP8 tensor cores (compute capability 8.9 or "
                f"later); {device_name} has {capability}")
    return None


def check_fp8_supported(device: torch.device, dtype: torch.dtype) -> None:
    """ValueError if FP8 projections cannot run on `device` (`fp8_refusal`), or if one small
    product (a row times a 16 x 16 weight) fails there (torch's rowwise kernels cover some
    architectures only). Called by the loader before it builds the model."""
    capability = name = None
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
    refusal = fp8_refusal(device.type, dtype, capability, name or device.type)
    if refusal is not None:
        raise ValueError(refusal)
    probe = nn.Linear(_DIM_MULTIPLE, _DIM_MULTIPLE, bias=False, device=device, dtype=dtype)
    try:
        with torch.no_grad():
            Fp8Linear.quantize(probe, use_triton=False)(probe.weight[:1])
    except RuntimeError as error:
        reason = (str(error).splitlines() or [repr(error)])[0]
        raise ValueError(f"quantization 'fp8' does not run on {name or device.type}: "
                         f"{reason}") from error


def quantize_rows(x: torch.Tensor, use_triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`(values, scales)` of rows `x` [rows, size]: float8 values [rows, size], row-major,
    and float32 scales [rows, 1], with `x ~= values * scales`. `use_triton`: one fused kernel
    (`layer_kernels.quantize_fp8_rows`; it allocates nothing but its outputs), else torch
    ops computing the same values (with two float32 temporaries the size of `x`)."""
    if use_triton:
        return layer_kernels().quantize_fp8_rows(x, FP8_DTYPE, MIN_SCALE)
    wide = x.float()  # `x` itself when float32: not written
    scales = (wide.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_(min=MIN_SCALE)
    values = (wide / scales).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return values.contiguous(), scales


class Fp8Linear(nn.Module):
    """`y = x W^T + b` with `W` in float8 e4m3 [out, in] and `weight_scale` float32 [1, out];
    `x` rows [rows, in] (any leading shape), `y` in `x`'s dtype. Built by `quantize` from an
    `nn.Linear`; holds no gradients. Its buffers are floating point to `Module.to`: convert
    a model's dtype before quantizing it, never after (the loader does)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None, use_triton: bool) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("bias", bias)
        self.use_triton = use_triton

    @classmethod
    @torch.no_grad()
    def quantize(cls, linear: nn.Linear, use_triton: bool) -> Fp8Linear:
        """`linear`'s weight rounded to float8, a scale per output channel (its bias kept);
        `use_triton` also quantizes the weight with the kernel. ValueError for a dimension
        that is not a multiple of 16 (`_scaled_mm` takes none on CUDA); whether the device
        can run it is `check_fp8_supported`'s."""
        weight = linear.weight
        out_features, in_features = weight.shape
        if out_features % _DIM_MULTIPLE or in_features % _DIM_MULTIPLE:
            raise ValueError(f"quantization 'fp8' needs projection sizes that are multiples "
                             f"of {_DIM_MULTIPLE}, got {in_features} -> {out_features}")
        values, scales = quantize_rows(weight, use_triton)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(values, scales.reshape(1, out_features).contiguous(), bias, use_triton)

    @property
    def out_features(self) -> int:
        """Output channels (the weight's rows)."""
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        values, scales = quantize_rows(rows, self.use_triton)
        out = torch._scaled_mm(values, self.weight.t(), scale_a=scales,
                               scale_b=self.weight_scale, out_dtype=x.dtype,
                               use_fast_accum=True)
        if self.bias is not None:
            out.add_(self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)


def quantize_projections(layers: nn.ModuleList, use_triton: bool) -> None:
    """Replaces each decoder layer's four projections by their `Fp8Linear`, one at a time:
    each weight is freed as its float8 copy is made, so the peak is the model plus one
    projection's float8 copy (plus, with torch's ops rather than the kernel, two float32
    temporaries of that projection's size). The MLPs must multiply gate and up as one
    product (`fuse_gate_up`): their halves are not `nn.Linear`s once quantized."""
    for layer in layers:
        if not layer.mlp.fuse_gate_up:
            raise ValueError("quantization 'fp8' needs the MLP's gate and up as one product "
                             "(fuse_gate_up)")
        for owner_name, name in _PROJECTIONS:
            owner = getattr(layer, owner_name)
            setattr(owner, name, Fp8Linear.quantize(getattr(owner, name), use_triton))
