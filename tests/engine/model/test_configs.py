"""The model configs shipped for benchmarks parse into the architectures they name."""

from __future__ import annotations

import json

import pytest

from engine.model.arch import ModelArch
from engine.model.configs import CONFIGS_DIR


@pytest.mark.parametrize("path", sorted(CONFIGS_DIR.glob("*.json")), ids=lambda path: path.stem)
def test_shipped_configs_parse(path) -> None:
    arch = ModelArch.from_hf_config(json.loads(path.read_text()))
    assert arch.num_attention_heads % arch.num_key_value_heads == 0


def test_llama_3_1_8b_has_its_published_shapes() -> None:
    config = json.loads((CONFIGS_DIR / "llama3.1-8b.json").read_text())
    arch = ModelArch.from_hf_config(config)
    assert (arch.num_hidden_layers, arch.hidden_size, arch.intermediate_size) == (32, 4096, 14336)
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (32, 8, 128)
    assert arch.vocab_size == 128256 and arch.rope_scaling.rope_type == "llama3"
