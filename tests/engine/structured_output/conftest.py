"""The tiny model's tokenizer, as llguidance's matcher sees it."""

from __future__ import annotations

from typing import Any

import llguidance.hf
import pytest

from engine.model.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> tuple[Any, Any]:
    hf_tokenizer = load_tokenizer("tiny")
    return hf_tokenizer, llguidance.hf.from_tokenizer(hf_tokenizer)
