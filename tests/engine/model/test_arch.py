from __future__ import annotations

import pytest

from engine.model.arch import ModelArch

BASE = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def test_llama_defaults() -> None:
    arch = ModelArch.from_hf_config(BASE)
    assert arch.num_key_value_heads == 4
    assert arch.head_dim == 16
    assert arch.rope_theta == 10000.0
    assert arch.rope_scaling.rope_type == "default"
    assert not (arch.qkv_bias or arch.o_bias or arch.qk_norm or arch.tie_word_embeddings)
    assert arch.kv_bytes_per_token(4) == 2 * 2 * 64 * 4


def test_legacy_and_new_rope_layouts_agree() -> None:
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    legacy = ModelArch.from_hf_config(
        {**BASE, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **scaling}})
    new = ModelArch.from_hf_config(
        {**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **scaling}})
    assert legacy == new
    assert new.rope_theta == 500000.0 and new.rope_scaling.factor == 8.0
    linear = ModelArch.from_hf_config({**BASE, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert linear.rope_scaling.rope_type == "linear"


def test_family_flags() -> None:
    qwen2 = ModelArch.from_hf_config({**BASE, "model_type": "qwen2", "num_key_value_heads": 2})
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.sliding_window is None
    qwen3 = ModelArch.from_hf_config({**BASE, "model_type": "qwen3", "head_dim": 24})
    assert qwen3.qk_norm and qwen3.head_dim == 24 and qwen3.q_size == 96
    llama = ModelArch.from_hf_config({**BASE, "attention_bias": True, "eos_token_id": [1, 2]})
    assert llama.qkv_bias and llama.o_bias and llama.eos_token_ids == (1, 2)
    mistral = ModelArch.from_hf_config({**BASE, "model_type": "mistral", "sliding_window": 4096})
    assert mistral.sliding_window == 4096


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"model_type": "gpt2"}, "unsupported model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope type"),
        ({"num_key_value_heads": 3}, "multiple of"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8,
          "layer_types": ["full_attention", "sliding_attention"]}, "mixing"),
    ],
)
def test_unsupported_configs_are_rejected(override: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelArch.from_hf_config({**BASE, **override})
