"""Tiny random Hugging Face checkpoints of each supported architecture, for parity tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

VOCAB_SIZE = 320
_COMMON = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.2,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}

ARCHITECTURES = ("llama3", "qwen2", "qwen3", "mistral")


def hf_config(name: str) -> PretrainedConfig:
    """Each config exercises the flags its family adds to plain Llama."""
    if name == "llama3":
        return LlamaConfig(
            **_COMMON, rope_theta=500000.0, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        )
    if name == "qwen2":
        return Qwen2Config(**_COMMON, tie_word_embeddings=True)
    if name == "qwen3":
        return Qwen3Config(**_COMMON, head_dim=24, tie_word_embeddings=False)
    if name == "mistral":
        return MistralConfig(**_COMMON, sliding_window=24, tie_word_embeddings=False)
    raise ValueError(name)


def make_hf_model(name: str, seed: int = 0) -> PreTrainedModel:
    """A float32 eval-mode model with non-trivial norm weights and biases."""
    torch.manual_seed(seed)
    config = hf_config(name)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif param_name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
    return model


def save_checkpoint(model: PreTrainedModel, directory: Path, **kwargs: object) -> Path:
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return directory
