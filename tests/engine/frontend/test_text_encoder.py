"""TextEncoder: the ids of the tokenizer's own `__call__`, and no ids for a text too long."""

from __future__ import annotations

import math
import random

import pytest
from tokenizers import (
    AddedToken,
    Tokenizer,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import PreTrainedTokenizerFast

from engine.frontend.text_encoder import EncodedText, TextEncoder
from engine.model.tokenizer import load_tokenizer
from tests.engine.model.real_model import require_real_model

CORPUS = ["the quick brown fox jumps over the lazy dog", "agents call tools, then wait",
          "naïve café \u2013 日本語のテキスト", "def f(x):\n    return x * 2\n"] * 20
TEXTS = ["", "the lazy fox", "<s> inside </s> text", "café 日本 🙂 tools", "a" * 300,
         "  leading and trailing  ", "return x * 2\n\n\n"]


@pytest.fixture(scope="module")
def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A small byte-level BPE with a BOS post-processor, and truncation and padding set on
    its Rust tokenizer, which `__call__` turns off (for good) and the encoder must not use."""
    rust = Tokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    rust.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", rust.token_to_id("<s>"))])
    rust.enable_truncation(max_length=4)
    rust.enable_padding(length=64, pad_id=rust.token_to_id("<pad>"), pad_token="<pad>")
    return PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_ids_are_those_of_the_tokenizer_call(bpe_tokenizer, add_special_tokens) -> None:
    encoder = TextEncoder(bpe_tokenizer)
    for text in TEXTS:
        expected = bpe_tokenizer(text, add_special_tokens=add_special_tokens).input_ids
        assert encoder.encode(text, add_special_tokens=add_special_tokens,
                              max_tokens=10_000) == EncodedText(len(expected), expected), text


def test_a_text_over_the_limit_is_counted_without_ids(bpe_tokenizer) -> None:
    encoder = TextEncoder(bpe_tokenizer)
    text = "the quick brown fox " * 50
    num_tokens = len(bpe_tokenizer(text, add_special_tokens=False).input_ids)
    fits = encoder.encode(text, add_special_tokens=False, max_tokens=num_tokens)
    assert fits.num_tokens == num_tokens and fits.token_ids is not None
    assert encoder.encode(text, add_special_tokens=False,
                          max_tokens=num_tokens - 1) == EncodedText(num_tokens, None)


def test_a_text_whose_length_proves_it_too_long_is_not_encoded(bpe_tokenizer,
                                                                monkeypatch) -> None:
    """No token of a byte-level BPE stands for more characters than its longest vocabulary
    entry has, so `len(text) / that` tokens is a lower bound, reported as one; texts within
    the bound are still encoded and counted exactly."""
    encoder = TextEncoder(bpe_tokenizer)
    bpe_tokenizer("warm up", add_special_tokens=False)  # turns the fixture's truncation off
    longest = max(map(len, bpe_tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)))
    encoded: list[str] = []
    real_encode = encoder._rust_encode_batch

    def recording(split_special_tokens: bool = False) -> object:
        encode_batch = real_encode(split_special_tokens)
        return lambda texts, **kwargs: encoded.extend(texts) or encode_batch(texts, **kwargs)

    monkeypatch.setattr(encoder, "_rust_encode_batch", recording)
    text = "the quick brown fox " * 50
    at_least = math.ceil(len(text) / longest)
    assert encoder.encode(text, add_special_tokens=False, max_tokens=at_least - 1) == (
        EncodedText(at_least, None, num_tokens_is_lower_bound=True))
    assert encoded == []
    exact = encoder.encode(text, add_special_tokens=False, max_tokens=at_least)
    assert encoded == [text] and exact.num_tokens >= at_least
    assert not exact.num_tokens_is_lower_bound


def test_the_bound_holds_for_random_texts(bpe_tokenizer) -> None:
    longest = max(map(len, bpe_tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)))
    rng = random.Random(0)
    pieces = [*TEXTS, *CORPUS[:4], "<s>", "</s>", " " * 30]
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        num_tokens = len(bpe_tokenizer(text, add_special_tokens=False).input_ids)
        assert math.ceil(len(text) / longest) <= num_tokens, text


def test_characters_the_vocabulary_cannot_spell_are_not_counted() -> None:
    """A vocabulary without some ASCII bytes (SmolLM2's lacks six control characters) drops
    them, or fuses a run of them into its unknown token: the bound counts only the rest."""
    rust = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = [symbol for symbol in pre_tokenizers.ByteLevel.alphabet() if symbol != "Z"]
    rust.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=alphabet, special_tokens=["<unk>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=rust)
    encoder = TextEncoder(tokenizer)
    longest = max(map(len, rust.get_vocab(with_added_tokens=True)))
    text = "Z" * 5_000 + "the quick brown fox " * 10
    actual = len(tokenizer(text, add_special_tokens=False).input_ids)
    refused = encoder.encode(text, add_special_tokens=False, max_tokens=1)
    assert refused == EncodedText(math.ceil(200 / longest), None,
                                  num_tokens_is_lower_bound=True)
    assert refused.num_tokens <= actual


def test_a_token_added_again_to_strip_whitespace_ends_the_bound() -> None:
    """Re-adding a token the vocabulary has, now with `lstrip`, keeps its size."""
    rust = Tokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<mask>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=rust)
    encoder = TextEncoder(tokenizer)
    text = " " * 2_000 + "<mask>"
    assert encoder.encode(text, add_special_tokens=False, max_tokens=0).num_tokens_is_lower_bound
    backend = tokenizer.backend_tokenizer  # a copy of `rust`
    size = backend.get_vocab_size(with_added_tokens=True)
    backend.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    assert backend.get_vocab_size(with_added_tokens=True) == size
    assert encoder.encode(text, add_special_tokens=False, max_tokens=0) == EncodedText(1, None)


def test_tokens_added_later_raise_the_bound(bpe_tokenizer) -> None:
    encoder = TextEncoder(bpe_tokenizer)
    token = "<" + "a-very-long-added-token" * 3 + ">"
    text = token * 10
    before = encoder.encode(text, add_special_tokens=False, max_tokens=5)
    bpe_tokenizer.add_tokens([token])
    after = encoder.encode(text, add_special_tokens=False, max_tokens=5)
    # Before, the longest entry was shorter: the same text was at least more tokens.
    assert before.num_tokens > 10 and before.num_tokens_is_lower_bound
    assert after == EncodedText(10, None, num_tokens_is_lower_bound=True)
    assert len(bpe_tokenizer(text, add_special_tokens=False).input_ids) == 10


@pytest.mark.parametrize("pipeline", ["normalizer", "removing split", "whitespace",
                                      "metaspace", "stripping added token",
                                      "missing bytes, fused unknowns", "missing bytes"])
def test_pipelines_that_may_drop_characters_are_always_encoded(pipeline) -> None:
    """A normalizer may delete or merge characters, a pre-tokenizer may drop some, and a
    Metaspace BPE's entries are not one character a byte, an added token that strips the
    whitespace beside it stands for any run of it, and so may the unknown token for bytes the
    vocabulary cannot spell (or they are dropped): no bound, every text encoded."""
    unknown = {"unk_token": "<unk>", "fuse_unk": True} if "fused" in pipeline else {}
    rust = Tokenizer(models.BPE(**unknown))
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pipeline == "normalizer":
        rust.normalizer = normalizers.NFC()
    elif pipeline == "removing split":
        rust.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(" ", "removed"), pre_tokenizers.ByteLevel(use_regex=False)])
    elif pipeline == "whitespace":
        rust.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Whitespace(), pre_tokenizers.ByteLevel(use_regex=False)])
    elif pipeline == "metaspace":
        rust.pre_tokenizer = pre_tokenizers.Metaspace()
    alphabet = [] if "missing bytes" in pipeline else pre_tokenizers.ByteLevel.alphabet()
    rust.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=alphabet, special_tokens=["<unk>"]))
    if pipeline == "stripping added token":
        rust.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=rust)
    text = {"normalizer": "e\u0301" * 2_000, "missing bytes": "Z" * 2_000,
            "missing bytes, fused unknowns": "Z" * 2_000}.get(pipeline, " " * 2_000 + "<mask>")
    expected = len(tokenizer(text, add_special_tokens=False).input_ids)
    encoded = TextEncoder(tokenizer).encode(text, add_special_tokens=False, max_tokens=0)
    assert (encoded.num_tokens, encoded.num_tokens_is_lower_bound) == (expected, False)


def test_a_fast_tokenizer_is_encoded_without_its_python_encoding_path(
        bpe_tokenizer, monkeypatch) -> None:
    """The point of the encoder: transformers' `_encode_plus` (which builds every id and mask
    value as a Python object, GIL held) is not run for a fast tokenizer."""
    encoder = TextEncoder(bpe_tokenizer)
    bpe_tokenizer("warm up", add_special_tokens=False)  # turns the fixture's truncation off
    calls: list[str] = []
    monkeypatch.setattr(type(bpe_tokenizer), "_encode_plus",
                        lambda self, text, *args, **kwargs: calls.append(text))
    encoded = encoder.encode("the quick brown fox " * 50, add_special_tokens=False,
                             max_tokens=10)
    assert encoded.token_ids is None and encoded.num_tokens > 10 and calls == []


def test_tokens_added_after_the_encoder_was_made_are_encoded(bpe_tokenizer) -> None:
    encoder = TextEncoder(bpe_tokenizer)
    bpe_tokenizer.add_tokens(["<tool>"])
    text = "call <tool> now"
    expected = bpe_tokenizer(text, add_special_tokens=False).input_ids
    assert bpe_tokenizer.convert_tokens_to_ids("<tool>") in expected
    assert encoder.encode(text, add_special_tokens=False, max_tokens=99).token_ids == expected


def test_a_class_that_changes_the_encoding_path_is_called(bpe_tokenizer) -> None:
    """As Code Llama's tokenizer rewrites `<FILL_ME>` prompts in `_encode_plus`."""
    class Infilling(type(bpe_tokenizer)):
        def _encode_plus(self, text, *args, **kwargs):
            return super()._encode_plus(text.replace("<FILL_ME>", "lazy"), *args, **kwargs)

    infilling = Infilling(tokenizer_object=bpe_tokenizer.backend_tokenizer)
    expected = bpe_tokenizer("the lazy dog", add_special_tokens=False).input_ids
    assert TextEncoder(infilling).encode("the <FILL_ME> dog", add_special_tokens=False,
                                         max_tokens=99).token_ids == expected


def test_a_tokenizer_without_a_rust_backend_is_called(tokenizer) -> None:
    class Plain:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def __call__(self, text: str, add_special_tokens: bool):
            self.calls.append(text)
            return tokenizer(text, add_special_tokens=add_special_tokens)

    plain = Plain()
    encoded = TextEncoder(plain).encode("hi 日", add_special_tokens=False, max_tokens=3)
    assert plain.calls == ["hi 日"]
    assert encoded == EncodedText(len("hi 日".encode()), None)


def test_the_real_models_ids_are_those_of_its_tokenizer_call() -> None:
    """Random texts of the pieces that tokenizers treat specially (the chat template's special
    tokens, whitespace runs, multi-byte characters) against `tokenizer(...)`."""
    tokenizer = load_tokenizer(str(require_real_model()))
    encoder = TextEncoder(tokenizer)
    # The control characters and the plane-4 one are bytes SmolLM2's vocabulary lacks.
    pieces = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", " ", "  " * 9, "\n", "\n\n", "\t",
              "h\u00e9llo", "\u65e5\u672c", "\U0001f642", "def f():", "<tool_call>", '{"a": 1}',
              "\u200b", "x" * 40, "\uff21", "\x04" * 30, "\x1d", "\U00040000"]
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 24)))
        for add_special_tokens in (True, False):
            expected = tokenizer(text, add_special_tokens=add_special_tokens).input_ids
            assert encoder.encode(text, add_special_tokens=add_special_tokens,
                                  max_tokens=10_000).token_ids == expected, text
            # With no room at all, every text the bound decides is refused with it.
            refused = encoder.encode(text, add_special_tokens=add_special_tokens, max_tokens=0)
            assert refused.num_tokens <= len(expected), text
