"""Prompt text to token ids, cheap for texts far longer than the model takes.

A chat of megabytes is a few seconds of tokenization on a thread the server shares with every
tenant. Through a Hugging Face tokenizer's `__call__`, most of that is harmless (the Rust
encoder releases the GIL), but the rest is not: the millions of ids and attention-mask values
become Python lists and the encoding's per-token strings and offsets are freed, all with the GIL
held, about 0.4 s for 8 MB, in which no other request's tokens are streamed. `TextEncoder`
encodes with the Rust tokenizer directly and without character offsets, counts the tokens
before anything becomes a Python object, and builds the id list only for a text that fits.

Encoding still holds about 125 bytes a token while it lives (1.3 GB for 9.7 MB of words with
SmolLM2's tokenizer). Where the tokenizer's pipeline bounds how many characters one token
can stand for (`_TokenBound`: a byte-level BPE without a normalizer, SmolLM2's and the tiny
model's among them), a text whose length alone proves it too long is not encoded: it has at
least (its length less the characters the vocabulary cannot spell) / that bound tokens.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer, models, pre_tokenizers

# The methods between a fast tokenizer's `__call__` and its Rust tokenizer (transformers 4.x
# and 5.x). A class that overrides one of them changes the text or the ids on the way (Code
# Llama's `<FILL_ME>` infilling, for one), so its calls are not bypassed.
_ENCODING_PATH = ("__call__", "_call_one", "encode_plus", "_encode_plus", "_batch_encode_plus")
# Pre-tokenizers that keep every byte of the text in some piece (a `Split` that removes what
# it matches does not; neither do `Whitespace` and `WhitespaceSplit`, which drop whitespace).
_BYTE_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Split", "Digits"})


@dataclass(frozen=True)
class EncodedText:
    """A text's token count and, when it is at most the `max_tokens` asked for, its ids. For
    a text too long that was not encoded, `num_tokens` is a lower bound
    (`num_tokens_is_lower_bound`)."""

    num_tokens: int
    token_ids: list[int] | None
    num_tokens_is_lower_bound: bool = False


class TextEncoder:
    """Encodes prompt texts with one Hugging Face tokenizer (shared, not owned: it reads the
    tokenizer's current vocabulary and settings at each call).

    Token ids are those of `tokenizer(text, add_special_tokens=...).input_ids`. A tokenizer
    without a Rust backend (a slow or test tokenizer), one whose class changes the encoding
    path, and a Rust backend set to truncate or pad (which `__call__` would turn off) are
    called as they are.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._backend = _bypassable_backend(tokenizer)
        self._splitting_backend: Any = None
        # (the vocabulary's size and added tokens, the `_TokenBound` for them).
        self._bound: tuple[object, _TokenBound | None] | None = None

    def encode(self, text: str, *, add_special_tokens: bool, max_tokens: int,
               split_special_tokens: bool = False) -> EncodedText:
        """`text` tokenized; `token_ids` is None when it has more than `max_tokens` tokens.
        With `split_special_tokens`, a special token's text in `text` is encoded as text
        (the tokenizers' option of that name). Called on the frontend's preparation threads
        or in its body-parsing children, never on the event loop."""
        encode_batch = self._rust_encode_batch(split_special_tokens)
        if encode_batch is None:
            token_ids = list(self._tokenizer(
                text, add_special_tokens=add_special_tokens,
                **({"split_special_tokens": True} if split_special_tokens else {})).input_ids)
            return EncodedText(len(token_ids),
                               token_ids if len(token_ids) <= max_tokens else None)
        # A text of at most `max_tokens` characters can never be shown too long by its
        # length: the usual prompt skips reading the pipeline (half a short text's encode).
        bound = self._token_bound() if len(text) > max_tokens else None
        if bound is not None and (at_least := bound.min_num_tokens(text, max_tokens)):
            return EncodedText(at_least, None, num_tokens_is_lower_bound=True)
        (encoding,) = encode_batch([text], add_special_tokens=add_special_tokens)
        num_tokens = len(encoding)
        return EncodedText(num_tokens, encoding.ids if num_tokens <= max_tokens else None)

    def _token_bound(self) -> _TokenBound | None:
        """The `_TokenBound` of the backend's current pipeline, its vocabulary read again
        only once tokens are added or changed."""
        backend = self._backend
        if not _bounds_chars_per_token(backend):
            return None
        added = backend.get_added_tokens_decoder()
        key = (backend.get_vocab_size(with_added_tokens=True),
               tuple((token.content, token.lstrip, token.rstrip) for token in added.values()))
        if self._bound is None or self._bound[0] != key:
            self._bound = (key, _TokenBound.of(backend))
        return self._bound[1]

    def _rust_encode_batch(self, split_special_tokens: bool = False) -> Any:
        """The backend's `encode_batch_fast` (`encode_batch` before tokenizers 0.21: both
        release the GIL; the first skips character offsets) while its settings are those
        `__call__` encodes with; else None. With `split_special_tokens`, that of a copy of
        the backend set to encode special tokens' texts as text (made once: the backend is
        shared by every thread, so its own setting is never changed)."""
        backend = self._backend
        if backend is None or backend.truncation is not None or backend.padding is not None:
            return None
        if bool(getattr(self._tokenizer, "split_special_tokens", False)):
            return None  # a tokenizer set so by its files: left to its own `__call__`
        if backend.encode_special_tokens:
            return None
        if split_special_tokens:
            if self._splitting_backend is None:
                copy = Tokenizer.from_str(backend.to_str())
                copy.encode_special_tokens = True
                self._splitting_backend = copy
            backend = self._splitting_backend
        return getattr(backend, "encode_batch_fast", backend.encode_batch)


def _bounds_chars_per_token(backend: Any) -> bool:
    """Whether no token of `backend`'s encodings stands for more characters of the text than
    the longest entry of its vocabulary (added tokens included) has: true of a byte-level
    BPE without a normalizer, whose entries spell the bytes they stand for one character a
    byte (a text has at least as many bytes as characters), whose pre-tokenizers drop no
    byte, and whose added tokens are matched as they are written (more conditions on the
    vocabulary: `_TokenBound`). A normalizer may delete
    or merge characters (NFC, Qwen2.5's), so any normalizer rules the bound out."""
    if backend.normalizer is not None or not isinstance(backend.model, models.BPE):
        return False
    pre_tokenizer = backend.pre_tokenizer
    if pre_tokenizer is None:
        return False
    state = json.loads(pre_tokenizer.__getstate__())
    steps = state.get("pretokenizers", [state]) if state.get("type") == "Sequence" else [state]
    kinds = [step.get("type") for step in steps]
    return ("ByteLevel" in kinds and set(kinds) <= _BYTE_KEEPING_PRE_TOKENIZERS
            and all(step.get("behavior") != "Removed" for step in steps))


@dataclass(frozen=True)
class _TokenBound:
    """A lower bound on a text's tokens for a tokenizer that `_bounds_chars_per_token`
    admits: no token touches more characters than `longest_entry_chars`, the longest entry
    of the vocabulary (added tokens included), and every character but those in
    `unspellable_chars` (ASCII characters whose byte the vocabulary lacks: BPE drops them,
    or its unknown token fuses a run of them) has a byte some token stands for. With
    `ascii_texts_only`, the vocabulary lacks a continuation byte too, so that a character of
    several bytes may have none: then only ASCII texts are bounded."""

    longest_entry_chars: int
    unspellable_chars: frozenset[str]
    ascii_texts_only: bool

    def min_num_tokens(self, text: str, max_tokens: int) -> int | None:
        """At least how many tokens `text` has, when that shows it has more than
        `max_tokens`; else None (the text must be encoded to tell). Counting the unspellable
        characters scans the text, so it is done only when the length alone would decide."""
        longest = self.longest_entry_chars
        if math.ceil(len(text) / longest) <= max_tokens:
            return None
        if self.ascii_texts_only and not text.isascii():
            return None
        spelled = len(text) - sum(text.count(char) for char in self.unspellable_chars)
        at_least = math.ceil(spelled / longest)
        return at_least if at_least > max_tokens else None

    @classmethod
    def of(cls, backend: Any) -> _TokenBound | None:
        """The bound of a backend that `_bounds_chars_per_token` admits; None when an added
        token strips the whitespace beside it (`lstrip`, `rstrip`: it then stands for a
        whitespace run of any length, 1,000 spaces and `<mask>` one token)."""
        added = backend.get_added_tokens_decoder().values()
        if _BYTE_LEVEL_SYMBOLS is None or any(token.lstrip or token.rstrip for token in added):
            return None
        vocab = backend.get_vocab(with_added_tokens=True)
        missing_bytes = {byte for symbol, byte in _BYTE_LEVEL_SYMBOLS.items()
                         if symbol not in vocab}
        return cls(max(map(len, vocab)),
                   frozenset(chr(byte) for byte in missing_bytes if byte < 0x80),
                   any(0x80 <= byte < 0xC0 for byte in missing_bytes))


def _byte_level_symbols() -> dict[str, int] | None:
    """The byte-level alphabet: the symbol that stands for each byte (GPT-2's mapping, which
    `pre_tokenizers.ByteLevel` uses: printable bytes are their own character, the others
    256 onwards, in order); None, and no bound, should the library's alphabet differ."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    symbols = {chr(byte): byte for byte in printable}
    symbols.update({chr(256 + index): byte for index, byte in enumerate(others)})
    return symbols if set(symbols) == set(pre_tokenizers.ByteLevel.alphabet()) else None


_BYTE_LEVEL_SYMBOLS = _byte_level_symbols()


def _bypassable_backend(tokenizer: Any) -> Any:
    """`tokenizer`'s Rust tokenizer if its class encodes through transformers' fast-tokenizer
    path unchanged; else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    for name in _ENCODING_PATH:
        if getattr(type(tokenizer), name, None) is not getattr(PreTrainedTokenizerFast, name,
                                                              None):
            return None
    return backend
