"""Loading a model's tokenizer (torch-free: the engine core decodes with it too).

The tokenizer's files are in the model's directory unless a separate tokenizer directory is
given (`ModelConfig.tokenizer`, `--tokenizer`); every loader here takes both.
"""

from __future__ import annotations

import functools
import json
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

# The names a tokenizer configuration gives the generic fast tokenizer (transformers 4 wrote
# the first, 5 writes the second; in 5 both name one class).
GENERIC_FAST_TOKENIZER_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})
# Model types (None: a tokenizer directory without a model) among those the engine runs whose
# tokenizer `AutoTokenizer` loads with the class its configuration names. Not qwen2, whose
# configurations transformers 5 overrides with `Qwen2Tokenizer` (rebuilt from the vocabulary,
# with a normalizer of its own), nor mistral, overridden when mistral-common is installed.
MODEL_TYPES_KEEPING_TOKENIZER_CLASS = frozenset({None, "llama", "qwen3"})


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
    `tokenizer` directory when given (see `tokenizer_dir`): the one `AutoTokenizer` loads.

    A directory whose tokenizer is the generic fast tokenizer (`_loads_as_generic_fast`) is
    loaded through that class directly. Importing `AutoTokenizer` imports transformers'
    model configuration classes, and with them torch (transformers 5): 4.9 s of CPU for the
    tiny model's tokenizer on this project's CPU machine, against 0.9 s, in every server's
    frontend process, which otherwise never imports torch.
    """
    directory = tokenizer_dir(model, tokenizer)
    try:
        if _loads_as_generic_fast(directory):
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(directory)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError, ImportError) as error:
        raise ValueError(f"no usable tokenizer in {directory}: {error}") from error


def _loads_as_generic_fast(directory: Path) -> bool:
    """Whether `AutoTokenizer` loads `directory`'s tokenizer as the generic fast tokenizer
    (`PreTrainedTokenizerFast`, `TokenizersBackend` in transformers 5): its
    `tokenizer_config.json` names that class and no code of its own (`auto_map`), it has a
    `tokenizer.json`, and the directory's model, if it holds one, is of a type for which
    transformers keeps the class the configuration names
    (`MODEL_TYPES_KEEPING_TOKENIZER_CLASS`)."""
    config = _read_json_object(directory / "tokenizer_config.json")
    model_config = _read_json_object(directory / "config.json")
    if config is None or model_config is None or not (directory / "tokenizer.json").is_file():
        return False
    return (config.get("tokenizer_class") in GENERIC_FAST_TOKENIZER_CLASSES
            and "auto_map" not in config
            and model_config.get("model_type") in MODEL_TYPES_KEEPING_TOKENIZER_CLASS)


def _read_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`: {} when there is no such file, None when it cannot be read
    as one."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


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
