"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) on the paged KV cache.

Parameter names follow Hugging Face checkpoints, except that the q/k/v projections are fused
into `qkv_proj` (one larger matmul, measurably faster) and the MLP's gate and up projections
into `gate_up_proj`; `load_weights` maps the checkpoint's separate tensors into their shards.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.model.arch import ModelArch
from engine.model.attention import AttentionMetadata
from engine.model.layers import RMSNorm, SwiGLUMLP
from engine.model.rope import PositionRotary, RotaryEmbedding

# checkpoint projection name -> (the fused parameter's module, the shard's index in it)
_FUSED_SHARDS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1),
                 "v_proj": ("qkv_proj", 2), "gate_proj": ("gate_up_proj", 0),
                 "up_proj": ("gate_up_proj", 1)}


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.shard_sizes = (arch.q_size, arch.kv_size, arch.kv_size)
        self.qkv_proj = nn.Linear(arch.hidden_size, sum(self.shard_sizes), bias=arch.qkv_bias)
        self.o_proj = nn.Linear(arch.q_size, arch.hidden_size, bias=arch.o_bias)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.scale = arch.head_dim**-0.5

    def forward(
        self, rotary: PositionRotary, hidden: torch.Tensor, kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        query, key, value = self.qkv_proj(hidden).split(self.shard_sizes, dim=-1)
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = rotary.apply(query, key)
        out = metadata.attend(query, key, value, kv_cache, self.scale)
        return self.o_proj(out.reshape(num_tokens, -1))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, use_triton: bool, fuse_gate_up: bool):
        super().__init__()
        self.self_attn = LlamaAttention(arch)
        self.mlp = SwiGLUMLP(arch.hidden_size, arch.intermediate_size, arch.mlp_bias, use_triton,
                             fuse_gate_up)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, use_triton)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, use_triton)

    def forward(
        self, rotary: PositionRotary, hidden: torch.Tensor, residual: torch.Tensor | None,
        kv_cache: torch.Tensor, metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(mlp output, residual stream)` from the previous layer's (the first layer gets
        the embeddings and no residual): each block's output is added to the residual stream
        by the norm that follows it, so the add and the norm are one fused kernel."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.forward_with_residual(hidden, residual)
        hidden = self.self_attn(rotary, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm.forward_with_residual(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch, max_positions: int, use_triton: bool,
                 fuse_gate_up: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.rotary = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta,
                                      arch.rope_scaling, use_triton)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, use_triton, fuse_gate_up)
                                    for _ in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, use_triton)


class LlamaForCausalLM(nn.Module):
    """The whole model. The runner owns the KV caches and passes them to every forward.

    With `use_triton_kernels` the layers' norms, rotary and SiLU run as fused Triton kernels
    (`engine.model.layer_kernels`; CUDA, or CPU under Triton's interpreter), else as torch ops.
    With `fuse_gate_up` each MLP's gate and up projections are one matmul (see `SwiGLUMLP`;
    the loader sets it on CUDA); the weights are the same either way.
    """

    def __init__(self, arch: ModelArch, max_positions: int, use_triton_kernels: bool = False,
                 fuse_gate_up: bool = False):
        super().__init__()
        self.arch = arch
        self.use_triton_kernels = use_triton_kernels
        self.model = LlamaModel(arch, max_positions, use_triton_kernels, fuse_gate_up)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states [tokens, hidden] of a flattened batch (see `attention`)."""
        hidden = self.model.embed_tokens(input_ids)
        rotary = self.model.rotary.for_positions(positions, hidden.dtype)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(rotary, hidden, residual, kv_cache, metadata)
        if residual is None:  # a model without layers
            return self.model.norm(hidden)
        return self.model.norm.forward_with_residual(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [rows, vocab] of selected hidden states."""
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies checkpoint tensors (Hugging Face names) into the parameters.

        Raises `ValueError` for a tensor with no matching parameter, a shape mismatch, or a
        parameter the checkpoint leaves unset.
        """
        params = dict(self.named_parameters())
        unset = {key for name in params if not self._is_tied_head(name)
                 for key in self._load_keys(name)}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or self._is_tied_head(name):
                continue
            target, loaded_key = self._target_for(name, params)
            if target.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(target.shape)}"
                )
            target.copy_(tensor)
            unset.discard(loaded_key)
        if unset:
            raise ValueError(f"checkpoint does not set parameters: {sorted(unset)[:8]}")

    def _load_keys(self, param_name: str) -> list[str]:
        """What must be loaded into a parameter: the whole of it, or each of its shards."""
        module_name = param_name.split(".")[-2] if "." in param_name else ""
        num_shards = sum(1 for fused, _ in _FUSED_SHARDS.values() if fused == module_name)
        if num_shards:
            return [f"{param_name}#{shard}" for shard in range(num_shards)]
        return [param_name]

    def _is_tied_head(self, name: str) -> bool:
        return self.arch.tie_word_embeddings and name.startswith("lm_head.")

    def _target_for(
        self, name: str, params: dict[str, nn.Parameter]
    ) -> tuple[torch.Tensor, str]:
        parts = name.split(".")
        fused = _FUSED_SHARDS.get(parts[-2]) if len(parts) >= 2 else None
        if fused is None:
            if name not in params:
                raise ValueError(f"checkpoint tensor {name} matches no model parameter")
            return params[name], name
        module_name, shard = fused
        param_name = ".".join([*parts[:-2], module_name, parts[-1]])
        if param_name not in params:
            raise ValueError(f"checkpoint tensor {name} matches no model parameter")
        sizes = self._shard_sizes(module_name)
        start = sum(sizes[:shard])
        return params[param_name].narrow(0, start, sizes[shard]), f"{param_name}#{shard}"

    def _shard_sizes(self, module_name: str) -> tuple[int, ...]:
        """Rows of each checkpoint tensor in a fused parameter, in shard order."""
        arch = self.arch
        if module_name == "qkv_proj":
            return (arch.q_size, arch.kv_size, arch.kv_size)
        if module_name == "gate_up_proj":
            return (arch.intermediate_size, arch.intermediate_size)
        raise ValueError(f"{module_name} is not a fused projection")
