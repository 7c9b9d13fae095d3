"""Regenerates the embedded `tiny` model's files in `engine/model/tiny/`.

The files are committed; run this only to change them:
`.venv/bin/python scripts/make_tiny_model.py`. The tokenizer is byte-level (every byte is one
token, so any text round-trips) followed by ChatML and tool-call special tokens. The weights
are not stored: they are drawn from `ModelConfig.seed` when the model loads.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

TINY_DIR = Path(__file__).resolve().parents[1] / "engine" / "model" / "tiny"

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
VOCAB_SIZE = 272  # 256 bytes + specials, padded with reserved tokens to a multiple of 16

MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
    "bos_token_id": None,
    "pad_token_id": 256,
    "eos_token_id": [258, 256],
}


def build_tokenizer() -> Tokenizer:
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {char: index for index, char in enumerate(sorted(byte_chars, key=_byte_of))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    reserved = [f"<|reserved_{i}|>" for i in range(VOCAB_SIZE - 256 - len(SPECIAL_TOKENS))]
    tokenizer.add_special_tokens(
        [AddedToken(text, special=True, normalized=False) for text in SPECIAL_TOKENS + reserved]
    )
    return tokenizer


def _byte_of(char: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's byte-to-unicode table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    if ord(char) in printable:
        return ord(char)
    missing = [b for b in range(256) if b not in printable]
    return missing[ord(char) - 256]


def main() -> None:
    tokenizer = build_tokenizer()
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    assert tokenizer.token_to_id("<|im_end|>") == MODEL_CONFIG["eos_token_id"][0]
    tokenizer.save(str(TINY_DIR / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "model_max_length": MODEL_CONFIG["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
    }
    (TINY_DIR / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (TINY_DIR / "config.json").write_text(json.dumps(MODEL_CONFIG, indent=2) + "\n")


if __name__ == "__main__":
    main()
