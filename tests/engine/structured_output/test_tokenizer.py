"""The grammars' tokenizer read without transformers: the same tokens, special tokens and EOS
as llguidance's view of the transformers tokenizer the frontend loads, and the transformers
route where `tokenizer.json` lacks an added token."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from engine.frontend.processor import InputProcessor
from engine.model.tiny import TINY_MODEL_DIR
from engine.model.tokenizer import load_tokenizer
from engine.structured_output.tokenizer import read_grammar_tokenizer
from tests.engine.model.real_model import REAL_MODEL, require_real_model


def _assert_same_tokenizer(directory: Path, model: str) -> None:
    hf_tokenizer = load_tokenizer(model)
    expected = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=len(hf_tokenizer))
    source = read_grammar_tokenizer(directory)
    assert source.eos_token_id == hf_tokenizer.eos_token_id
    actual = llguidance.LLTokenizer(source.tokenizer_json, n_vocab=len(hf_tokenizer),
                                    eos_token=source.eos_token_id)
    assert actual.vocab_size == expected.vocab_size
    assert actual.eos_tokens == expected.eos_tokens
    for token_id in range(expected.vocab_size):
        assert actual.decode_bytes([token_id]) == expected.decode_bytes([token_id]), token_id
        assert actual.is_special_token(token_id) == expected.is_special_token(token_id)


def test_the_tiny_tokenizer_is_read_as_transformers_loads_it():
    _assert_same_tokenizer(TINY_MODEL_DIR, "tiny")


def test_the_real_models_tokenizer_is_read_as_transformers_loads_it():
    _assert_same_tokenizer(require_real_model(), REAL_MODEL)


def test_the_eos_is_the_one_the_frontend_gives_requests():
    processor = InputProcessor(load_tokenizer("tiny"), vocab_size=272, max_model_len=64)
    assert read_grammar_tokenizer(TINY_MODEL_DIR).eos_token_id == processor.eos_token_id == 258


def test_an_added_token_missing_from_tokenizer_json_is_read_through_transformers(tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_MODEL_DIR / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {"272": {
        "content": "<extra_token>", "special": True, "lstrip": False, "rstrip": False,
        "normalized": False, "single_word": False}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    source = read_grammar_tokenizer(tmp_path)
    tokenizer = llguidance.LLTokenizer(source.tokenizer_json, n_vocab=273,
                                       eos_token=source.eos_token_id)
    assert tokenizer.decode_bytes([272]) == b"<extra_token>"
    assert source.eos_token_id == 258


def test_the_eos_may_be_named_in_the_special_tokens_map(tmp_path):
    shutil.copy(TINY_MODEL_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": {"content": "<|endoftext|>", "special": True}}))
    source = read_grammar_tokenizer(tmp_path)
    assert source.eos_token_id == load_tokenizer("tiny").convert_tokens_to_ids("<|endoftext|>")


def test_a_directory_without_a_fast_tokenizer_is_a_clear_error(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="no fast tokenizer for grammars"):
        read_grammar_tokenizer(tmp_path)


def _tiny_copy(directory: Path, config_update: dict, special_map: dict | None = None) -> None:
    shutil.copy(TINY_MODEL_DIR / "tokenizer.json", directory / "tokenizer.json")
    config = json.loads((TINY_MODEL_DIR / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, **config_update}))
    if special_map is not None:
        (directory / "special_tokens_map.json").write_text(json.dumps(special_map))


def test_the_eos_is_picked_from_the_two_files_as_transformers_picks_it(tmp_path):
    """`special_tokens_map.json` names the EOS over `tokenizer_config.json` unless the
    config lists its added tokens."""
    plain, listed = tmp_path / "plain", tmp_path / "listed"
    plain.mkdir()
    listed.mkdir()
    _tiny_copy(plain, {}, {"eos_token": "<|endoftext|>"})
    added = {"258": {"content": "<|im_end|>", "special": True}}
    _tiny_copy(listed, {"added_tokens_decoder": added}, {"eos_token": "<|endoftext|>"})
    for directory in (plain, listed):
        expected = AutoTokenizer.from_pretrained(directory).eos_token_id
        assert read_grammar_tokenizer(directory).eos_token_id == expected
    assert read_grammar_tokenizer(plain).eos_token_id != read_grammar_tokenizer(
        listed).eos_token_id


def test_a_named_special_token_missing_from_tokenizer_json_is_read_through_transformers(
        tmp_path):
    _tiny_copy(tmp_path, {"extra_special_tokens": ["<|brand_new|>"]})
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    new_id = hf_tokenizer.convert_tokens_to_ids("<|brand_new|>")
    source = read_grammar_tokenizer(tmp_path)
    tokenizer = llguidance.LLTokenizer(source.tokenizer_json, n_vocab=len(hf_tokenizer),
                                       eos_token=source.eos_token_id)
    assert tokenizer.decode_bytes([new_id]) == b"<|brand_new|>"


def test_an_unreadable_tokenizer_json_is_a_value_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": "nothing"}')
    with pytest.raises(ValueError, match="cannot read"):
        read_grammar_tokenizer(tmp_path)
