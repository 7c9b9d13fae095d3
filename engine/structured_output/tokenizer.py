"""The tokenizer that the engine core's grammar matchers see, read without transformers.

llguidance's matchers need the model's fast tokenizer serialized as `tokenizers` writes it.
`llguidance.hf.from_tokenizer` gets it through transformers, whose import and tokenizer
loading take seconds of CPU in Python, holding the GIL: on the core's compile thread that
stalled the step loop when the first grammar arrived
(docs/decisions/0020-structured-output-limits.md). Reading `tokenizer.json` with the
`tokenizers` library takes milliseconds to a fraction of a second. llguidance's `LLTokenizer`
constructor holds the GIL too, so a served core builds it before taking requests
(`EngineCore.prepare_grammars`).
"""

from __future__ import annotations

import json
from copy import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class GrammarTokenizerSource:
    """A model's fast tokenizer serialized as llguidance reads it (the JSON of the
    `tokenizers` library, padding and truncation off), and the id of the EOS token its
    configuration names (None when it names none)."""

    tokenizer_json: str
    eos_token_id: int | None


def read_grammar_tokenizer(directory: Path) -> GrammarTokenizerSource:
    """The tokenizer in `directory` as transformers loads it for the frontend: read from its
    `tokenizer.json` with the `tokenizers` library when that file holds every token that
    `tokenizer_config.json` and `special_tokens_map.json` name (the added tokens at the ids
    listed); otherwise loaded through transformers, which adds them (seconds of CPU).
    ValueError if neither can load it."""
    from tokenizers import Tokenizer

    config = _read_json(directory / "tokenizer_config.json")
    special_map = _read_json(directory / "special_tokens_map.json")
    path = directory / "tokenizer.json"
    if path.is_file():
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:  # the tokenizers library raises a bare Exception
            raise ValueError(f"cannot read {path}: {error}") from error
        if _holds_named_tokens(tokenizer, config, special_map):
            eos_token_id = _named_eos_token_id(tokenizer, config, special_map)
            return GrammarTokenizerSource(_serialized(tokenizer), eos_token_id)
    return _read_through_transformers(directory)


def _holds_named_tokens(tokenizer: Any, config: dict[str, Any],
                        special_map: dict[str, Any]) -> bool:
    added = config.get("added_tokens_decoder")
    for token_id, token in (added.items() if isinstance(added, dict) else ()):
        content = _content(token)
        if content is None or tokenizer.token_to_id(content) != _as_int(token_id):
            return False
    named: list[Any] = []
    for source in (config, special_map):
        for key, value in source.items():
            if key.endswith("_token"):
                named.append(value)
            elif key in ("additional_special_tokens", "extra_special_tokens"):
                named += value if isinstance(value, list) else []
    return all(tokenizer.token_to_id(content) is not None
               for content in map(_content, named) if content is not None)


def _named_eos_token_id(tokenizer: Any, config: dict[str, Any],
                        special_map: dict[str, Any]) -> int | None:
    """The id of the EOS token as transformers picks it: `special_tokens_map.json`'s over
    `tokenizer_config.json`'s unless the latter lists its added tokens (a string or an
    added-token object either way); None when neither names one."""
    sources = (config,) if "added_tokens_decoder" in config else (special_map, config)
    for source in sources:
        eos = _content(source.get("eos_token"))
        if eos is not None:
            token_id = tokenizer.token_to_id(eos)
            return None if token_id is None else int(token_id)
    return None


def _content(token: Any) -> str | None:
    """A token's text, named as a string or as an added-token object."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _read_through_transformers(directory: Path) -> GrammarTokenizerSource:
    from transformers import AutoTokenizer

    try:
        hf_tokenizer = AutoTokenizer.from_pretrained(directory)
        backend = hf_tokenizer.backend_tokenizer
    except (OSError, ValueError, ImportError, AttributeError) as error:
        raise ValueError(f"no fast tokenizer for grammars in {directory}: {error}") from error
    return GrammarTokenizerSource(_serialized(copy(backend)), hf_tokenizer.eos_token_id)


def _serialized(tokenizer: Any) -> str:
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return str(tokenizer.to_str())


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _as_int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None
