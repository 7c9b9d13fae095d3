"""The core's grammar manager on its own: compiles and their limits, the cache's byte budget,
masks computed off the step loop, accepting tokens, forgetting."""

from __future__ import annotations

import functools
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import llguidance
import numpy as np
import pytest

from engine.config import StructuredOutputConfig
from engine.model.tiny import TINY_MODEL_DIR
from engine.structured_output import grammars
from engine.structured_output import output_manager as manager_module
from engine.structured_output.grammars import MAX_ERROR_CHARS
from engine.structured_output.output_manager import (
    StructuredOutputManager,
    allocated_bytes,
)
from engine.structured_output.spec import StructuredOutputSpec
from engine.structured_output.tokenizer import GrammarTokenizerSource, read_grammar_tokenizer
from tests.engine.helpers import FakeClock
from tests.engine.structured_output.tokenizer_builds import CountingTokenizers

EOS = 258
VOCAB = 272
LOAD_TINY = functools.partial(read_grammar_tokenizer, TINY_MODEL_DIR)


def _make(config: StructuredOutputConfig | None = None, *,
          load: Callable[[], GrammarTokenizerSource] = LOAD_TINY,
          clock: Callable[[], float] | None = None) -> StructuredOutputManager:
    kwargs: dict[str, Any] = {} if clock is None else {"clock": clock}
    return StructuredOutputManager(load, VOCAB, config=config, **kwargs)


@pytest.fixture
def manager() -> Iterator[StructuredOutputManager]:
    grammar_manager = _make()
    yield grammar_manager
    grammar_manager.shutdown()


def _spec(grammar: str, param: str | None = "response_format") -> StructuredOutputSpec:
    return StructuredOutputSpec(kind="grammar", grammar=grammar, param=param)


def _outcomes(manager: StructuredOutputManager) -> list[Any]:
    outcomes = []
    while manager.num_compiling:
        manager.wait_for_work(1.0)
        outcomes += manager.pop_compiled()
    return outcomes


def _compiled(manager: StructuredOutputManager, request_id: str, grammar: str) -> None:
    manager.submit(request_id, _spec(grammar), EOS)
    outcomes = _outcomes(manager)
    assert all(outcome.failure is None for outcome in outcomes), outcomes


def _ready(manager: StructuredOutputManager) -> Any:
    """The masks in flight, once they are all done (and the round that collected them)."""
    while True:
        masks = manager.await_masks()
        if not masks.held_back:
            return masks
        manager.wait_for_work(1.0)


def _allowed(words: np.ndarray) -> list[int]:
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:VOCAB]
    return bits.nonzero()[0].tolist()


def test_prepare_builds_the_tokenizer_on_the_calling_thread_for_the_requests_eos(
        monkeypatch, caplog):
    tokenizers = CountingTokenizers()
    monkeypatch.setattr(llguidance, "LLTokenizer", tokenizers)
    reads = []
    manager = _make(load=lambda: reads.append(1) or LOAD_TINY())
    try:
        manager.prepare(None)  # the tokenizer's own EOS, which the tiny model names: 258
        assert tokenizers.builds == [(EOS, threading.current_thread().name)]
        _compiled(manager, "r", grammars.choice_grammar(["ab"]))
        assert len(tokenizers.builds) == 1 and len(reads) == 1
        with caplog.at_level(logging.WARNING, logger=manager_module.__name__):
            manager.submit("other-eos", _spec(grammars.choice_grammar(["ab"])), 0)
            assert [outcome.failure for outcome in _outcomes(manager)] == [None]
        assert tokenizers.builds[1][0] == 0 and tokenizers.builds[1][1].startswith("grammar")
        assert "for EOS 0 beside the step loop (prepared for EOS 258)" in caplog.text
        assert len(reads) == 1
    finally:
        manager.shutdown()


def test_masks_follow_the_grammar_and_end_with_eos(manager):
    _compiled(manager, "r", grammars.choice_grammar(["ab", "ac"]))
    _ready(manager)
    assert manager.bitmask(["other"]) is None
    mask = manager.bitmask(["other", "r"])
    assert mask.req_ids == ["r"] and mask.words.shape == (1, (VOCAB + 31) // 32)
    assert _allowed(mask.words[0]) == [ord("a")]
    assert manager.accept("r", [ord("a")]) is None
    _ready(manager)
    assert _allowed(manager.bitmask(["r"]).words[0]) == [ord("b"), ord("c")]
    assert manager.accept("r", [ord("c")]) is None
    _ready(manager)
    assert _allowed(manager.bitmask(["r"]).words[0]) == [EOS]
    assert manager.accept("r", [EOS], finished=True) is None
    assert not manager.request_ids


def test_a_rejected_token_fails_the_request_naming_its_field(manager):
    _compiled(manager, "r", grammars.regex_grammar("[0-9]+"))
    _ready(manager)
    failure = manager.accept("r", [ord("x")])
    assert failure.request_id == "r" and failure.param == "response_format"
    assert failure.error.startswith("response_format: the output left its grammar")
    assert not manager.request_ids


def test_a_bad_grammar_fails_its_request_only_and_is_not_cached(manager):
    _compiled(manager, "good", grammars.choice_grammar(["x"]))
    manager.submit("bad", _spec("start: nope\n", param="structured_outputs.grammar"), EOS)
    (outcome,) = _outcomes(manager)
    assert outcome.request_id == "bad" and outcome.failure.param == "structured_outputs.grammar"
    assert "nope" in outcome.failure.error and "\n" not in outcome.failure.error
    assert len(outcome.failure.error) <= MAX_ERROR_CHARS + len("structured_outputs.grammar: ")
    assert manager.request_ids == {"good"} and not manager.compiling_request_ids
    manager.submit("bad-again", _spec("start: nope\n"), EOS)
    _outcomes(manager)
    assert manager.num_compiles == 3  # the failure was compiled again, not served from cache


def test_a_grammar_over_the_byte_limit_fails_and_is_not_cached():
    manager = _make(StructuredOutputConfig(max_grammar_bytes=1 << 20))
    try:
        grammar = grammars.regex_grammar("(a{1000}){16}")  # about 6 MB compiled
        for request_id in ("a", "b"):
            manager.submit(request_id, _spec(grammar, "structured_outputs.regex"), EOS)
            (outcome,) = _outcomes(manager)
            assert outcome.failure.error == (
                "structured_outputs.regex: the grammar is too large: compiling it takes more "
                "than the limit of 1 MiB")
        assert manager.num_compiles == 2 and manager.cached_bytes == 0
    finally:
        manager.shutdown()


@pytest.mark.skipif(allocated_bytes() is None, reason="the C library cannot report its heap")
def test_the_byte_limit_stops_a_compile_before_it_allocates_past_it():
    """The lexer gets the fuel the limit buys: a grammar whose lexer would take 170 MiB stops
    at its fuel, within the limit, and fails at compile (llguidance itself reports its lexer
    out of fuel only at the next token). One that fits compiles under the same limits."""
    source = LOAD_TINY()
    tokenizer = llguidance.LLTokenizer(source.tokenizer_json, n_vocab=VOCAB,
                                       eos_token=source.eos_token_id)
    limit = 16 << 20
    limits = manager_module.compile_limits(limit)
    huge = grammars.json_schema_grammar({"type": "string", "pattern": "^(a{1000}){1950}$"})
    heap_before = allocated_bytes()
    with pytest.raises(manager_module.LexerLimitError, match="too many expressions"):
        manager_module.compile_grammar(tokenizer, huge, limits)
    assert allocated_bytes() - heap_before < limit
    matcher, _, _ = manager_module.compile_grammar(
        tokenizer, grammars.json_schema_grammar({"enum": [f"v{index}" for index in range(1000)]}),
        limits)
    assert matcher.consume_token(ord('"'))


def test_a_refused_compile_leaves_the_heap_where_it_was():
    """A failed compile's matcher is freed when the compile ends, not left to the cycle
    collector (disabled here) through its error's traceback."""
    manager = _make(StructuredOutputConfig(max_grammar_bytes=16 << 20))
    gc.disable()
    try:
        _compiled(manager, "warm-up", grammars.choice_grammar(["x"]))
        heap_before, cached_bytes = allocated_bytes(), manager.cached_bytes
        for repeat in range(1950, 1954):
            manager.submit(f"r{repeat}", _spec(grammars.regex_grammar(
                f"(a{{1000}}){{{repeat}}}"), "structured_outputs.regex"), EOS)
            (outcome,) = _outcomes(manager)
            assert "the grammar is too large" in outcome.failure.error
        if heap_before is not None:
            assert allocated_bytes() - heap_before < 2 << 20
        assert manager.cached_bytes == cached_bytes and manager.num_compiles == 5
    finally:
        gc.enable()
        manager.shutdown()


@pytest.mark.skipif(allocated_bytes() is None, reason="the C library cannot report its heap")
def test_the_cache_keeps_to_its_byte_budget_least_recently_used_first_out():
    budget = 8 << 20
    # These grammars' masks take milliseconds: on a loaded machine one can pass the default
    # mask budget's bounds and fail its request, which is not what this test is about.
    manager = _make(StructuredOutputConfig(grammar_cache_bytes=budget,
                                           grammar_mask_budget_s=1.0))
    try:
        sizes = []
        for count in range(8, 16):  # each about 3-6 MB compiled
            _compiled(manager, f"r{count}", grammars.regex_grammar(f"(a{{1000}}){{{count}}}"))
            sizes.append(manager.cached_bytes)
            assert manager.cached_bytes <= budget
        assert sizes[-1] > 2 << 20  # grammars were measured, not charged their text
        # The most recent grammar is still cached; the first one was evicted.
        _compiled(manager, "again-last", grammars.regex_grammar("(a{1000}){15}"))
        _compiled(manager, "again-first", grammars.regex_grammar("(a{1000}){8}"))
        assert manager.num_cache_hits == 1 and manager.num_compiles == 9
    finally:
        manager.shutdown()


def test_a_compile_past_its_deadline_fails_at_the_deadline_counted_from_its_start(
        monkeypatch):
    """The deadline counts from when a worker starts the compile: one queued behind it (the
    compiles are measured one at a time) does not fail with it."""
    clock, entered, release = FakeClock(), threading.Event(), threading.Event()
    real_compile = manager_module.compile_grammar

    def blocked_compile(tokenizer: Any, grammar: str, limits: Any) -> Any:
        entered.set()
        release.wait(30.0)
        return real_compile(tokenizer, grammar, limits)

    monkeypatch.setattr(manager_module, "compile_grammar", blocked_compile)
    manager = _make(StructuredOutputConfig(max_grammar_compile_s=5.0), clock=clock)
    try:
        manager.submit("r", _spec(grammars.choice_grammar(["x"]), "tools"), EOS)
        assert entered.wait(30.0)
        manager.submit("queued", _spec(grammars.choice_grammar(["y"])), EOS)
        clock.advance(4.0)
        assert manager.pop_compiled() == [] and manager.num_compiling == 2
        clock.advance(2.0)
        (outcome,) = manager.pop_compiled()
        assert outcome.request_id == "r"
        assert outcome.failure.error == "tools: the grammar took longer than 5 s to compile"
        assert manager.compiling_request_ids == {"queued"} and manager.cached_bytes == 0
        release.set()
        assert [outcome.failure for outcome in _outcomes(manager)] == [None]
        _compiled(manager, "r2", grammars.choice_grammar(["x"]))
        assert manager.num_compiles == 3  # the overdue grammar was not cached
    finally:
        release.set()
        manager.shutdown()


@pytest.mark.skipif(allocated_bytes() is None, reason="the C library cannot report its heap")
def test_compiles_whose_requests_left_are_charged_to_the_cache_or_cancelled():
    budget = 8 << 20
    manager = _make(StructuredOutputConfig(grammar_cache_bytes=budget))
    try:
        for count in range(8, 20):  # each about 3-7 MB compiled
            manager.submit(f"gone{count}", _spec(grammars.regex_grammar(
                f"(a{{1000}}){{{count}}}")), EOS)
            manager.remove([f"gone{count}"])
        _compiled(manager, "last", grammars.choice_grammar(["x"]))
        assert 0 < manager.cached_bytes <= budget
    finally:
        manager.shutdown()


class _GatedManager(StructuredOutputManager):
    """Masks wait for `gate` before they are computed (a mask that is slow to come, using no
    CPU meanwhile)."""

    gate = threading.Event()

    def _compute_mask(self, *args: Any) -> Any:
        self.gate.wait(30.0)
        return super()._compute_mask(*args)


def test_a_request_whose_mask_is_late_is_held_back_and_others_are_not():
    manager = _GatedManager(LOAD_TINY, VOCAB,
                            config=StructuredOutputConfig(grammar_mask_budget_s=0.001))
    try:
        _GatedManager.gate.clear()
        _compiled(manager, "fast", grammars.choice_grammar(["ab"]))
        _compiled(manager, "late", grammars.choice_grammar(["ab"]))
        assert not manager.await_masks().held_back  # first masks come from the compile
        assert manager.accept("late", [ord("a")]) is None
        masks = manager.await_masks()
        assert masks.held_back == {"late"} and not masks.failures
        assert manager.bitmask(["fast"]).req_ids == ["fast"]
        with pytest.raises(RuntimeError, match="before its mask is ready"):
            manager.bitmask(["late"])
        _GatedManager.gate.set()
        assert not _ready(manager).failures
        assert manager.bitmask(["late", "fast"]).req_ids == ["late", "fast"]
    finally:
        _GatedManager.gate.set()
        manager.shutdown()


@pytest.mark.parametrize(("budget_s", "num_repeats"), [(0.002, 64), (0.01, 160)])
def test_a_grammar_whose_masks_overrun_the_budget_fails_alone(budget_s, num_repeats):
    """Masks of at least about 7 and 18 ms for 64 and 160 repeats: far over a 2 ms budget,
    the first one (at compile, which also builds the lexer) fails the grammar; well over a
    10 ms budget, three of them do, or the first one is already over three budgets: either
    way only this request ends. (With 64 repeats against 10 ms, a fast machine's masks took
    7 ms once another grammar had been compiled, and the grammar never failed.)"""
    manager = _make(StructuredOutputConfig(grammar_mask_budget_s=budget_s,
                                           max_grammar_bytes=256 << 20))  # 160: 72 MiB
    try:
        _compiled(manager, "fast", grammars.choice_grammar(["ab"]))
        # A lexer of `num_repeats` thousand states.
        slow = grammars.regex_grammar(f"(a{{1000}}){{{num_repeats}}}")
        manager.submit("slow", _spec(slow), EOS)
        failures = [outcome.failure for outcome in _outcomes(manager) if outcome.failure]
        for _ in range(10):
            if failures:
                break
            masks = _ready(manager)
            failures += masks.failures
            if "slow" in manager.request_ids:
                assert manager.accept("slow", [ord("a")]) is None
        (failure,) = failures
        assert failure.request_id == "slow"
        assert failure.error.startswith("response_format: the grammar is too slow")
        assert manager.request_ids == {"fast"}
    finally:
        manager.shutdown()


def test_a_rejected_token_reports_no_parser_state_nor_grammar():
    """llguidance's verbose errors carry the tokens so far, the parser's counters and the
    whole grammar after their first line; the core's matchers are built without them."""
    source = LOAD_TINY()
    tokenizer = llguidance.LLTokenizer(source.tokenizer_json, n_vocab=VOCAB,
                                       eos_token=source.eos_token_id)
    schema = grammars.json_schema_grammar({"type": "object", "properties": {
        "secret_field": {"type": "integer"}}, "required": ["secret_field"]})
    matcher, _, _ = manager_module.compile_grammar(tokenizer, schema)
    assert all(matcher.consume_token(byte) for byte in b'{"secret_field": 1')
    assert not matcher.consume_token(ord("z"))
    error = matcher.get_error()
    assert error.startswith("Parser Error: token") and "doesn't satisfy the grammar" in error
    assert "<state>" not in error and "secret_field" not in error


def test_remove_forgets_requests_and_duplicates_are_refused(manager):
    _compiled(manager, "r", grammars.choice_grammar(["x"]))
    with pytest.raises(ValueError, match="already"):
        manager.submit("r", _spec("start: \"x\"\n"), EOS)
    manager.remove(["r", "unknown"])
    assert not manager.request_ids and manager.bitmask(["r"]) is None
    assert not manager.await_masks().held_back


class _HeldCompiles(StructuredOutputManager):
    """Compiles wait for `gate` before they start (a compile that takes as long as a test
    wants, using no CPU meanwhile)."""

    gate = threading.Event()

    def _compile(self, *args: Any) -> Any:
        self.gate.wait(30.0)
        return super()._compile(*args)


class _StartOrder(StructuredOutputManager):
    """Records the grammars in the order their compiles start; the first compile waits for
    `gate`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.started: list[str] = []
        self.gate = threading.Event()

    def _compile(self, grammar: str, *args: Any) -> Any:
        self.started.append(grammar)
        if len(self.started) == 1:
            self.gate.wait(30.0)
        return super()._compile(grammar, *args)


def test_compiles_are_taken_by_tenants_in_turn_not_first_come_first_served():
    """A tenant's backlog of grammars delays another tenant's next one by at most the compile
    running: the flood's first compile is held while it queues three more, then the victim
    sends two grammars, the second one the flood queued already (it starts in the victim's
    turn, as the flood's turn comes later)."""
    manager = _StartOrder(LOAD_TINY, VOCAB)
    flood = [grammars.choice_grammar([f"f{index}"]) for index in range(4)]
    victim = grammars.choice_grammar(["v"])
    try:
        manager.submit("f0", _spec(flood[0]), EOS, "flood")
        deadline_s = time.monotonic() + 30
        while not manager.started:
            assert time.monotonic() < deadline_s
            time.sleep(0.01)
        for index in range(1, 4):
            manager.submit(f"f{index}", _spec(flood[index]), EOS, "flood")
        manager.submit("v", _spec(victim), EOS, "victim")
        manager.submit("v-shared", _spec(flood[3]), EOS, "victim")
        manager.gate.set()
        outcomes = _outcomes(manager)
        assert sorted(outcome.request_id for outcome in outcomes if not outcome.failure) == [
            "f0", "f1", "f2", "f3", "v", "v-shared"]
        assert manager.started == [flood[0], victim, flood[1], flood[3], flood[2]]
        assert (manager.num_compiles, manager.num_cache_hits) == (5, 1)
    finally:
        manager.gate.set()
        manager.shutdown()


def test_wake_ends_a_wait_for_a_compile_at_once():
    manager = _HeldCompiles(LOAD_TINY, VOCAB)
    try:
        _HeldCompiles.gate.clear()
        manager.submit("r", _spec(grammars.choice_grammar(["ab"])), EOS)
        waited = threading.Event()
        waiter = threading.Thread(target=lambda: (manager.wait_for_work(60.0), waited.set()))
        waiter.start()
        assert not waited.wait(0.2)  # the compile is held: the wait goes on
        manager.wake()
        assert waited.wait(10.0)
        assert manager.num_compiling == 1 and not manager.pop_compiled()
        _HeldCompiles.gate.set()
        assert [outcome.failure for outcome in _outcomes(manager)] == [None]
        waiter.join()
    finally:
        _HeldCompiles.gate.set()
        manager.shutdown()


def test_a_wait_returns_at_once_when_a_compile_already_finished(manager):
    manager.submit("r", _spec(grammars.choice_grammar(["ab"])), EOS)
    manager.wait_for_work(10.0)
    manager.submit("cached", _spec(grammars.choice_grammar(["ab"])), EOS)  # done already
    waited = threading.Event()
    waiter = threading.Thread(target=lambda: (manager.wait_for_work(60.0), waited.set()))
    waiter.start()
    assert waited.wait(10.0)
    waiter.join()
    assert {outcome.request_id for outcome in _outcomes(manager)} == {"r", "cached"}
