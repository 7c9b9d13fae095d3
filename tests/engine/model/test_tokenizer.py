"""engine.model.tokenizer: loading gives the tokenizer `AutoTokenizer` gives, and a generic
fast tokenizer loads without importing torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.model.tiny import TINY_MODEL_DIR
from engine.model.tokenizer import (
    GENERIC_FAST_TOKENIZER_CLASSES,
    MODEL_TYPES_KEEPING_TOKENIZER_CLASS,
    load_tokenizer,
)
from tests.engine.model.real_model import require_real_model

TEXTS = ["Hello, world!", "  two  spaces\tand a tab\n", "héllo wörld ✓ 漢字 🙂", "e\u0301",
         "<|im_start|>user\nhi<|im_end|>", "<tool_call>{\"a\": 1}</tool_call>", "a" * 300]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function",
                     "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "content": "sunny, 21 C"},
]
TOOLS = [{"type": "function", "function": {
    "name": "weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def tokenizer_directory(which: str) -> Path:
    return TINY_MODEL_DIR if which == "tiny" else require_real_model()


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_a_generic_fast_tokenizer_loads_as_auto_tokenizer_loads_it(which: str) -> None:
    directory = tokenizer_directory(which)
    loaded = load_tokenizer(str(directory))
    expected = AutoTokenizer.from_pretrained(directory)
    assert type(loaded) is type(expected)
    for add_special_tokens in (True, False):
        for text in TEXTS:
            assert (loaded(text, add_special_tokens=add_special_tokens).input_ids
                    == expected(text, add_special_tokens=add_special_tokens).input_ids)
    ids = expected("<|im_start|>user\nhéllo<|im_end|>", add_special_tokens=False).input_ids
    for skip_special_tokens in (True, False):
        assert (loaded.decode(ids, skip_special_tokens=skip_special_tokens)
                == expected.decode(ids, skip_special_tokens=skip_special_tokens))
    assert (loaded.eos_token_id, loaded.all_special_ids, loaded.chat_template) \
        == (expected.eos_token_id, expected.all_special_ids, expected.chat_template)
    assert {i: (t.content, t.special) for i, t in loaded.added_tokens_decoder.items()} \
        == {i: (t.content, t.special) for i, t in expected.added_tokens_decoder.items()}
    for tools in (None, TOOLS):
        assert loaded.apply_chat_template(CONVERSATION, tools=tools, tokenize=False,
                                          add_generation_prompt=True) \
            == expected.apply_chat_template(CONVERSATION, tools=tools, tokenize=False,
                                            add_generation_prompt=True)


def copy_tiny_tokenizer(directory: Path, *, tokenizer_class: str | None = None,
                        model_type: str | None = None, auto_map: bool = False,
                        with_model: bool = True) -> Path:
    """The tiny model's tokenizer files in `directory` (and its `config.json` if
    `with_model`), the configuration changed as asked."""
    names = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
    for name in [*names, "config.json"] if with_model else names:
        shutil.copy(TINY_MODEL_DIR / name, directory / name)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    if tokenizer_class is not None:
        config["tokenizer_class"] = tokenizer_class
    if auto_map:
        config["auto_map"] = {"AutoTokenizer": [None, "tokenization_custom.CustomTokenizer"]}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if model_type is not None:
        model_config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**model_config,
                                                           "model_type": model_type}))
    return directory


@pytest.mark.parametrize("tokenizer_class", sorted(GENERIC_FAST_TOKENIZER_CLASSES))
@pytest.mark.parametrize("model_type", sorted(MODEL_TYPES_KEEPING_TOKENIZER_CLASS, key=str))
def test_every_configuration_loaded_directly_is_what_auto_tokenizer_loads(
        tmp_path: Path, tokenizer_class: str, model_type: str | None) -> None:
    """The configurations `load_tokenizer` loads without `AutoTokenizer`, against it (a
    transformers upgrade that overrides one of them fails here)."""
    directory = copy_tiny_tokenizer(tmp_path, tokenizer_class=tokenizer_class,
                                    model_type=model_type, with_model=model_type is not None)
    # A tokenizer directory without a model is the `tokenizer` one of a model's.
    loaded = load_tokenizer("tiny", str(directory))
    expected = AutoTokenizer.from_pretrained(directory)
    assert type(loaded) is type(expected)
    assert [loaded(text).input_ids for text in TEXTS] \
        == [expected(text).input_ids for text in TEXTS]
    assert loaded.eos_token_id == expected.eos_token_id


def test_a_tokenizer_of_its_own_class_loads_through_auto_tokenizer(tmp_path: Path) -> None:
    directory = copy_tiny_tokenizer(tmp_path, tokenizer_class="GPT2Tokenizer")
    assert type(load_tokenizer(str(directory))).__name__ == "GPT2Tokenizer"


@pytest.mark.parametrize("changes", [{"auto_map": True}, {"model_type": "mistral"},
                                     {"model_type": "qwen2"}],
                         ids=["own-code", "mistral", "qwen2"])
def test_configurations_auto_tokenizer_may_override_load_through_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, changes: dict[str, object]) -> None:
    directory = copy_tiny_tokenizer(tmp_path, **changes)  # type: ignore[arg-type]
    calls: list[Path] = []
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", calls.append)
    load_tokenizer(str(directory))
    assert calls == [directory]


def test_loading_a_generic_fast_tokenizer_imports_no_torch() -> None:
    """The frontend's process (the server's main one) stays without torch: the tokenizer was
    its only path to it."""
    code = ("import sys\n"
            "import engine.entrypoints.serve\n"
            "from engine.model.tokenizer import load_tokenizer\n"
            "tokenizer = load_tokenizer('tiny')\n"
            "print(tokenizer('hi').input_ids, 'torch' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=120)
    assert result.stdout.split()[-1] == "False", result.stdout
