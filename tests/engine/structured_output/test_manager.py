"""The core's grammar manager on its own: compile, masks, accepting tokens, forgetting."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from engine.model.tokenizer import load_tokenizer
from engine.structured_output import grammars
from engine.structured_output.manager import StructuredOutputManager
from engine.structured_output.spec import StructuredOutputSpec

EOS = 258
VOCAB = 272


@pytest.fixture
def manager():
    grammar_manager = StructuredOutputManager(functools.partial(load_tokenizer, "tiny"), VOCAB)
    yield grammar_manager
    grammar_manager.shutdown()


def _compiled(manager: StructuredOutputManager, request_id: str, grammar: str) -> None:
    manager.submit(request_id, StructuredOutputSpec(kind="grammar", grammar=grammar), EOS)
    while manager.num_compiling:
        manager.wait_for_compile(1.0)
        outcomes = manager.pop_compiled()
        assert all(outcome.error is None for outcome in outcomes), outcomes


def _allowed(words: np.ndarray) -> list[int]:
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:VOCAB]
    return bits.nonzero()[0].tolist()


def test_masks_follow_the_grammar_and_end_with_eos(manager):
    _compiled(manager, "r", grammars.choice_grammar(["ab", "ac"]))
    assert manager.bitmask(["other"]) is None
    mask = manager.bitmask(["other", "r"])
    assert mask.req_ids == ["r"] and mask.words.shape == (1, (VOCAB + 31) // 32)
    assert _allowed(mask.words[0]) == [ord("a")]
    assert manager.accept("r", [ord("a")]) is None
    assert _allowed(manager.bitmask(["r"]).words[0]) == [ord("b"), ord("c")]
    assert manager.accept("r", [ord("c")]) is None
    assert _allowed(manager.bitmask(["r"]).words[0]) == [EOS]
    assert manager.accept("r", [EOS]) is None


def test_a_rejected_token_is_an_error(manager):
    _compiled(manager, "r", grammars.regex_grammar("[0-9]+"))
    assert "grammar" in manager.accept("r", [ord("x")])


def test_a_bad_grammar_fails_its_request_only(manager):
    manager.submit("bad", StructuredOutputSpec(kind="grammar", grammar="start: nope\n"), EOS)
    manager.wait_for_compile(5.0)
    (outcome,) = manager.pop_compiled()
    assert outcome.request_id == "bad" and "nope" in outcome.error
    assert not manager.request_ids and not manager.compiling_request_ids


def test_remove_forgets_requests_and_duplicates_are_refused(manager):
    _compiled(manager, "r", grammars.choice_grammar(["x"]))
    with pytest.raises(ValueError, match="already"):
        manager.submit("r", StructuredOutputSpec(kind="choice", grammar="start: \"x\"\n"), EOS)
    manager.remove(["r", "unknown"])
    assert not manager.request_ids and manager.bitmask(["r"]) is None
