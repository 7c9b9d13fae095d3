"""A traced `EngineCore` on the tiny model: every record type, with shared step numbers."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from pathlib import Path

import msgspec

from engine.config import CacheConfig, EngineConfig, TraceConfig
from engine.core.engine_core import EngineCore
from engine.request import JobInfo
from tests.continuum.priced import PRICED_CONTINUUM_PATH
from tests.engine.core.conftest import SMALL_CONFIG, core_request
from tests.engine.core.test_engine_core import run_to_completion
from tests.engine.helpers import FakeClock
from tracing.reader import read_trace
from tracing.records import (
    RECORD_TYPES,
    PinDeclined,
    PinPinned,
    PrefixCacheEvent,
    StepDecision,
    StepSnapshot,
)
from tracing.summary import summarize


def _traced_config(tmp_path: Path, **trace: object) -> EngineConfig:
    # Rebuilding a context costs 0.01 s per token: the cold-start TTL ln(R) pins contexts
    # of more than 100 tokens and declines shorter ones.
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"points": [[0, 0.0], [500, 5.0], [1000, 10.0]]}))
    return dataclasses.replace(
        SMALL_CONFIG,
        cache=CacheConfig(num_kv_blocks=24),
        scheduler=dataclasses.replace(SMALL_CONFIG.scheduler, policy=PRICED_CONTINUUM_PATH,
                                      policy_options={"prefill_profile": str(profile)}),
        trace=TraceConfig(path=str(tmp_path / "trace.jsonl"), **trace),  # type: ignore[arg-type]
    )


def _turn(request_id: str, prompt: list[int], job: JobInfo | None, max_tokens: int):
    return msgspec.structs.replace(core_request(request_id, prompt, max_tokens=max_tokens),
                                   job=job)


def _tokens(start: int, count: int) -> list[int]:
    """Distinct prompts within the tiny model's vocabulary."""
    return [(start + k) % 250 + 5 for k in range(count)]


def _run_agent_workload(core: EngineCore) -> None:
    long_prompt = _tokens(0, 150)
    core.add_request(_turn("long#0", long_prompt, JobInfo(job_id="long", tool_name="bash"), 4))
    core.add_request(_turn("short#0", _tokens(7, 20), JobInfo(job_id="short"), 2))
    outputs = run_to_completion(core)
    next_prompt = long_prompt + outputs["long#0"] + _tokens(11, 10)
    core.add_request(_turn("long#1", next_prompt, JobInfo(job_id="long", is_last_step=True), 2))
    run_to_completion(core)
    for index in range(3):  # three growing requests that cannot all fit: preemptions
        core.add_request(_turn(f"grow{index}", _tokens(13 + 60 * index, 60),
                               None, 100))
    core.add_request(_turn("aborted", [7, 8, 9], None, 50))
    core.step()
    core.abort_requests(["aborted"])
    run_to_completion(core)


def test_a_traced_engine_records_every_record_type_with_shared_step_numbers(tmp_path) -> None:
    core = EngineCore(_traced_config(tmp_path), clock=FakeClock())
    _run_agent_workload(core)
    stats = core.stats()
    core.shutdown()

    trace = read_trace(tmp_path / "trace.jsonl")
    assert trace.header.config["scheduler"]["policy"] == PRICED_CONTINUUM_PATH
    assert trace.header.policy == "continuum"
    assert trace.header.num_kv_blocks == 24 and not trace.incomplete_tail
    kinds = Counter(type(event) for event in trace.events)
    assert set(kinds) | {type(trace.header)} == set(RECORD_TYPES.values()) - {
        RECORD_TYPES["truncated"]}
    snapshot_steps = [e.step for e in trace.events if isinstance(e, StepSnapshot)]
    decision_steps = [e.step for e in trace.events if isinstance(e, StepDecision)]
    assert snapshot_steps == decision_steps == list(range(core.num_steps))

    pinned = next(e for e in trace.events if isinstance(e, PinPinned))
    assert (pinned.job_id, pinned.inputs.tool, pinned.inputs.source) == ("long", "bash",
                                                                         "cold-start")
    assert pinned.inputs.rebuild_s == pinned.inputs.benefit_s
    assert pinned.ttl_s == math.log(pinned.inputs.benefit_s) > 0
    declined = next(e for e in trace.events if isinstance(e, PinDeclined))
    assert declined.job_id == "short" and declined.inputs.ttl_s == 0.0
    second_turn = next(e for e in trace.events
                       if isinstance(e, PrefixCacheEvent) and e.request_id == "long#1")
    assert second_turn.num_pin_hit_tokens == pinned.num_blocks * 16

    summary = summarize(trace)
    assert summary.preemptions == stats.num_preemptions > 0
    assert summary.pins.num_pinned == stats.num_pins_created
    assert summary.pins.released == stats.pins_released == {"reused": 1}
    assert summary.finished == {"abort": 1, "length": 6}
    assert summary.recomputed_tokens == stats.recomputed_tokens > 0


def test_the_size_cap_truncates_a_live_trace_and_the_engine_goes_on(tmp_path) -> None:
    core = EngineCore(_traced_config(tmp_path, max_bytes=4096), clock=FakeClock())
    _run_agent_workload(core)
    assert core.scheduler.tracer is None  # dropped once the cap was reached
    core.shutdown()
    path = tmp_path / "trace.jsonl"
    assert path.stat().st_size <= 4096
    assert read_trace(path).truncated
