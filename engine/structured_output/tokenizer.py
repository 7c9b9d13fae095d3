"""The tokenizer that the engine core's grammar matchers see, read without transformers.

llguidance's matchers need the model's fast tokenizer serialized as `tokenizers` writes it.
`llguidance.hf.from_tokenizer` gets it through transformers: importing transformers and
loading the tokenizer take seconds of CPU in Python (3.8 s for the tiny model, 5.4 s for
SmolLM2 on this machine), holding the GIL. Done on the core's compile thread when the first
grammar arrived, that made the step loop wait for the GIL at each torch call, and other
tenants' decoding stalled for seconds (`continuum bench grammars --attack stall`). Reading
`tokenizer.json` with the `tokenizers` library takes milliseconds to a fifth of a second,
and the serving core does it at start-up (`StructuredOutputManager.prepare`), since
llguidance's `LLTokenizer` constructor holds the GIL too (0.4 s for SmolLM2's 49,152
tokens).
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
    `tokenizer.json` with the `tokenizers` library when that file holds every added token that
    `tokenizer_config.json` lists, at the id listed there; otherwise loaded through
    transformers, which merges them (seconds of CPU). ValueError if neither can load it."""
    from tokenizers import Tokenizer

    config = _read_json(directory / "tokenizer_config.json")
    path = directory / "tokenizer.json"
    if path.is_file():
        tokenizer = Tokenizer.from_file(str(path))
        if _holds_added_tokens(tokenizer, config):
            eos_token_id = _configured_eos_token_id(tokenizer, directory, config)
            return GrammarTokenizerSource(_serialized(tokenizer), eos_token_id)
    return _read_through_transformers(directory)


def _holds_added_tokens(tokenizer: Any, config: dict[str, Any]) -> bool:
    added = config.get("added_tokens_decoder")
    if not isinstance(added, dict):
        return True
    for token_id, token in added.items():
        content = token.get("content") if isinstance(token, dict) else None
        if not isinstance(content, str) or tokenizer.token_to_id(content) != _as_int(token_id):
            return False
    return True


def _configured_eos_token_id(tokenizer: Any, directory: Path,
                             config: dict[str, Any]) -> int | None:
    """The id of the EOS token named in `tokenizer_config.json`, else in
    `special_tokens_map.json` (a string or an added-token object), as transformers reads it."""
    for source in (config, _read_json(directory / "special_tokens_map.json")):
        eos = source.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            token_id = tokenizer.token_to_id(eos)
            return None if token_id is None else int(token_id)
    return None


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
