"""Where a model's files live, and its architecture read from them; torch-free.

`"tiny"` names the embedded default model (`engine/model/tiny/`); a name of the catalogue
(`engine.model.catalog`, such as `smollm2-135m-instruct`) names its checkout in the model cache,
which `continuum models pull NAME` fills; any other name is a local Hugging Face directory.
Nothing is downloaded here.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.model.arch import ModelArch
from engine.model.catalog import CATALOG, cached_checkout
from engine.model.tiny import TINY_MODEL_DIR

TINY_MODEL_NAME = "tiny"


def resolve_model_dir(model: str) -> Path:
    """The directory holding the model's `config.json` (and tokenizer files)."""
    if model == TINY_MODEL_NAME:
        return TINY_MODEL_DIR
    if model in CATALOG:
        return cached_checkout(model)
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model {model!r} is not 'tiny', a catalogued model ({', '.join(CATALOG)}; fetched "
            "by `continuum models pull NAME`) or a local directory with a config.json"
        )
    return path


def load_arch(model: str) -> ModelArch:
    """The architecture described by the model's `config.json`."""
    config = json.loads((resolve_model_dir(model) / "config.json").read_text())
    return ModelArch.from_hf_config(config)
