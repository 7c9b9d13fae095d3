"""Structured outputs in the engine core: grammars compile off the step loop, every step masks
the constrained rows, the output matches its grammar, and nothing leaks."""

from __future__ import annotations

import json
import logging
import re
import threading
from dataclasses import replace

import jsonschema
import llguidance
import pytest

from engine.core.engine_core import EngineCore
from engine.core.wire import EngineCoreRequest
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from engine.structured_output import grammars
from engine.structured_output.spec import StructuredOutputSpec
from tests.engine.core.conftest import SMALL_CONFIG
from tests.engine.structured_output.tokenizer_builds import CountingTokenizers

EOS = 258  # the tiny model's <|im_end|>
SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tag": {"type": "string", "maxLength": 4}}, "required": ["ok", "n", "tag"],
    "additionalProperties": False}


@pytest.fixture(scope="module")
def core():
    engine_core = EngineCore(SMALL_CONFIG)
    yield engine_core
    engine_core.shutdown()


def _request(request_id: str, spec: StructuredOutputSpec | None, *, seed: int = 0,
             max_tokens: int = 64, **params: object) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id, prompt_token_ids=[72, 105, 33, 10], eos_token_id=EOS,
        sampling_params=SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                                       structured_output=spec, **params))


def _run(core: EngineCore, max_steps: int = 500) -> dict[str, list]:
    """Steps until idle, checking invariants after every step; tokens and ends per request."""
    results: dict[str, list] = {}
    for _ in range(max_steps):
        if not core.has_work():
            return results
        for output in core.step():
            entry = results.setdefault(output.request_id, [[], None, None])
            entry[0].extend(output.new_token_ids)
            if output.finish_reason is not None:
                entry[1], entry[2] = output.finish_reason, output.error
        core.check_invariants()
    raise AssertionError("the core did not go idle")


def _text(token_ids: list[int]) -> str:
    return bytes(token for token in token_ids if token < 256).decode("utf-8", "replace")


def _spec(kind, grammar) -> StructuredOutputSpec:
    return StructuredOutputSpec(kind=kind, grammar=grammar)


def test_constrained_and_free_requests_share_batches(core):
    json_spec = _spec("json_schema", grammars.json_schema_grammar(SCHEMA))
    regex_spec = _spec("regex", grammars.regex_grammar(r"[a-f]{2}-[0-9]{1,3}"))
    for seed in range(6):
        core.add_request(_request(f"json-{seed}", json_spec, seed=seed))
        core.add_request(_request(f"regex-{seed}", regex_spec, seed=seed))
        core.add_request(_request(f"free-{seed}", None, seed=seed, max_tokens=12))
    results = _run(core)
    for seed in range(6):
        token_ids, reason, _ = results[f"json-{seed}"]
        assert reason is FinishReason.STOP and token_ids[-1] == EOS
        jsonschema.validate(json.loads(_text(token_ids[:-1])), SCHEMA)
        token_ids, reason, _ = results[f"regex-{seed}"]
        assert re.fullmatch(r"[a-f]{2}-[0-9]{1,3}", _text(token_ids[:-1]))
        assert len(results[f"free-{seed}"][0]) >= 1
    assert core.structured_outputs.request_ids == set()


def test_a_grammar_compiles_once_and_is_reused(core):
    spec = _spec("choice", grammars.choice_grammar(["north", "south", "east"]))
    compiles_before = core.structured_outputs.num_compiles
    for index in range(4):
        core.add_request(_request(f"choice-{index}", spec, seed=index))
    results = _run(core)
    assert core.structured_outputs.num_compiles == compiles_before + 1
    assert core.structured_outputs.num_cache_hits >= 3
    for token_ids, reason, _ in results.values():
        assert _text(token_ids[:-1]) in ("north", "south", "east") and reason is FinishReason.STOP


def test_requests_wait_for_their_grammar_without_blocking_others(core):
    spec = _spec("json_schema", grammars.json_schema_grammar(
        {**SCHEMA, "properties": {**SCHEMA["properties"], "new": {"type": "null"}}}))
    core.add_request(_request("held", spec))
    assert core.num_waiting_requests >= 1 and core.has_work()
    assert "held" in core.structured_outputs.compiling_request_ids | (
        core.structured_outputs.request_ids)
    core.check_invariants()
    results = _run(core)
    assert results["held"][1] is FinishReason.STOP


def test_abort_while_compiling_or_running_leaves_nothing(core):
    spec = _spec("regex", grammars.regex_grammar(r"[a-z]{30}"))
    core.add_request(_request("compiling", _spec("regex", grammars.regex_grammar("q{1,9}z"))))
    core.abort_requests(["compiling"])
    core.add_request(_request("running", spec))
    for _ in range(5):
        core.step()
    core.abort_requests(["running"])
    core.check_invariants()
    _run(core)
    assert not core.structured_outputs.request_ids
    assert not core.structured_outputs.compiling_request_ids
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_kv_blocks


def test_a_grammar_the_engine_cannot_compile_is_rejected_alone(core):
    core.add_request(_request("bad", _spec("grammar", "start: missing_rule\n")))
    core.add_request(_request("fine", None, max_tokens=4))
    results = _run(core)
    token_ids, reason, error = results["bad"]
    assert reason is FinishReason.ABORT and not token_ids and "grammar" in error
    assert results["fine"][1] is not None


def test_duplicate_ids_and_ignore_eos_are_refused(core):
    spec = _spec("choice", grammars.choice_grammar(["a"]))
    core.add_request(_request("dup", spec))
    with pytest.raises(ValueError, match="already in use"):
        core.add_request(_request("dup", spec))
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_output=spec)
    _run(core)


def test_min_tokens_does_not_hold_a_finished_grammar_open(core):
    core.add_request(_request("short", _spec("choice", grammars.choice_grammar(["ok"])),
                              min_tokens=10))
    token_ids, reason, _ = _run(core)["short"]
    assert _text(token_ids[:-1]) == "ok" and reason is FinishReason.STOP
    assert token_ids[-1] == EOS and EOS not in token_ids[:-1]  # one EOS, not one a step


def test_the_serving_core_prepares_the_grammars_tokenizer_before_it_serves(monkeypatch):
    """`prepare_grammars` (which a served frontend calls at start-up with its EOS) builds
    the tokenizer of that EOS on the calling thread; a constrained request then compiles
    with no other build, so the compile thread never builds one beside the step loop."""
    tokenizers = CountingTokenizers()
    monkeypatch.setattr(llguidance, "LLTokenizer", tokenizers)
    engine_core = EngineCore(SMALL_CONFIG)
    try:
        assert engine_core.prepare_grammars(EOS)
        assert tokenizers.builds == [(EOS, threading.current_thread().name)]
        engine_core.add_request(_request("r", _spec("choice", grammars.choice_grammar(["yes"]))))
        assert _run(engine_core)["r"][1] is FinishReason.STOP
        assert len(tokenizers.builds) == 1
    finally:
        engine_core.shutdown()


def test_grammars_that_cannot_be_prepared_are_logged_not_fatal(tmp_path, caplog):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    config = replace(SMALL_CONFIG, model=replace(SMALL_CONFIG.model, tokenizer=str(tmp_path)))
    engine_core = EngineCore(config)
    try:
        with caplog.at_level(logging.WARNING, logger="engine.core.engine_core"):
            assert not engine_core.prepare_grammars(EOS)
        assert "grammars cannot be prepared: no fast tokenizer for grammars" in caplog.text
    finally:
        engine_core.shutdown()
