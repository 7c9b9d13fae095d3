"""Loading a model's tokenizer (torch-free: the engine core decodes with it too).

The tokenizer's files are in the model's directory unless a separate tokenizer directory is
given (`ModelConfig.tokenizer`, `--tokenizer`); every loader here takes both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from engine.model.directory import TINY_MODEL_NAME, resolve_model_dir
from engine.model.tiny import TINY_MODEL_DIR

# Files of which a tokenizer loads from at least one (fast, SentencePiece, BPE, WordPiece,
# tiktoken). Without any, transformers would fail with an unrelated message (a missing
# sentencepiece or tiktoken package).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "vocab.txt", "spiece.model", "tiktoken.model")


def tokenizer_dir(model: str, tokenizer: str | None = None) -> Path:
    """The directory the tokenizer loads from: `tokenizer` (`"tiny"` or a local directory)
    when given, else the model's. ValueError naming the directory, and the `--tokenizer`
    flag, when it holds no tokenizer files."""
    if tokenizer is None:
        directory = resolve_model_dir(model)
        whose = "the model directory"
    else:
        directory = TINY_MODEL_DIR if tokenizer == TINY_MODEL_NAME else Path(tokenizer).expanduser()
        whose = "the tokenizer directory"
        if not directory.is_dir():
            raise ValueError(f"the tokenizer directory {directory} does not exist (--tokenizer)")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"{whose} {directory} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); "
            "give a directory that has them with --tokenizer DIR (tokenizer= in Python)")
    return directory


def load_tokenizer(model: str, tokenizer: str | None = None) -> Any:
    """The Hugging Face tokenizer of `model` (`"tiny"` or a local directory), from the
    `tokenizer` directory when given (see `tokenizer_dir`)."""
    from transformers import AutoTokenizer

    directory = tokenizer_dir(model, tokenizer)
    try:
        return AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError, ImportError) as error:
        raise ValueError(f"no usable tokenizer in {directory}: {error}") from error


def load_decoder(model: str, tokenizer: str | None = None) -> Callable[[Sequence[int]], str] | None:
    """Token ids to text with the `tokenizer.json` of the tokenizer's directory (see
    `tokenizer_dir`), special tokens kept (None if there is none). Light enough for the engine
    core, which does not load `transformers`."""
    try:
        from tokenizers import Tokenizer

        path = tokenizer_dir(model, tokenizer) / "tokenizer.json"
        decoder = Tokenizer.from_file(str(path)) if path.is_file() else None
    except Exception:  # no tokenizer files, or an unreadable or unknown format: no decoder
        return None
    if decoder is None:
        return None
    return functools.partial(decoder.decode, skip_special_tokens=False)
