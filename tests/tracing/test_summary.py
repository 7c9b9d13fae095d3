"""`summarize` against a small hand-built trace whose figures are worked out by hand."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from tests.tracing.builders import header, write_trace
from tracing.compare import compare
from tracing.reader import read_trace
from tracing.records import (
    JobEnded,
    PinDeclined,
    PinPinned,
    PinReleased,
    Preemption,
    PrefixCacheEvent,
    RequestArrived,
    RequestFinished,
    StepDecision,
    StepSnapshot,
    TTLInputs,
)
from tracing.summary import (
    Distribution,
    HostTierSummary,
    TraceSummary,
    render,
    summarize,
)


def _snapshot(step: int, time_s: float) -> StepSnapshot:
    return StepSnapshot(step=step, time_s=time_s, running_ids=[], waiting_ids=[],
                        num_total_blocks=16, num_free_blocks=16, num_cached_free_blocks=0,
                        num_pinned_blocks=0, pinned_job_ids=[], token_budget=64,
                        max_num_seqs=8)


def _decision(step: int, time_s: float, tokens: dict[str, int], **fields) -> StepDecision:
    for name in ("new_ids", "resumed_ids"):
        fields.setdefault(name, [])
    return StepDecision(step=step, time_s=time_s, num_scheduled_tokens=tokens,
                        total_num_scheduled_tokens=sum(tokens.values()), **fields)


def _admit(step, time_s, request_id, job_id, prompt, hit, pin_hit=0, resumed=False):
    return PrefixCacheEvent(step=step, time_s=time_s, request_id=request_id, job_id=job_id,
                            num_prompt_tokens=prompt, num_hit_tokens=hit,
                            num_pin_hit_tokens=pin_hit, resumed=resumed)


def _finish(step, time_s, request_id, job_id, reason="stop"):
    return RequestFinished(step=step, time_s=time_s, request_id=request_id, job_id=job_id,
                           reason=reason, num_prompt_tokens=1, num_output_tokens=1)


# Job a: two turns, the second reusing the first's pin. Job b: one turn, preempted once.
# Job c: its first turn's pin was declined, its second never admitted. "solo": no job.
HAND_BUILT = [
    RequestArrived(step=0, time_s=0.0, request_id="a#0", job_id="a", num_prompt_tokens=20),
    RequestArrived(step=0, time_s=0.0, request_id="solo", num_prompt_tokens=5),
    _snapshot(0, 0.0),
    _admit(0, 0.0, "a#0", "a", prompt=20, hit=0),
    _decision(0, 0.0, {"a#0": 20}, new_ids=["a#0"]),
    RequestArrived(step=1, time_s=0.5, request_id="b#0", job_id="b", num_prompt_tokens=12,
                   is_last_turn=True),
    _snapshot(1, 0.5),
    _admit(1, 0.5, "solo", None, prompt=5, hit=4),
    _admit(1, 0.5, "b#0", "b", prompt=12, hit=0),
    _decision(1, 0.5, {"a#0": 1, "solo": 1, "b#0": 12}, new_ids=["solo", "b#0"]),
    _snapshot(2, 1.0),
    _decision(2, 1.0, {"a#0": 1}, preempted=[
        Preemption(request_id="b#0", job_id="b", needed_by="a#0", num_computed_tokens=12)]),
    _finish(2, 1.0, "a#0", "a", reason="length"),
    PinPinned(step=2, time_s=1.0, job_id="a", request_id="a#0", num_blocks=5, ttl_s=2.0),
    _snapshot(3, 1.5),
    _admit(3, 1.5, "b#0", "b", prompt=13, hit=4, resumed=True),
    _decision(3, 1.5, {"solo": 1, "b#0": 9}, resumed_ids=["b#0"]),
    _finish(3, 1.5, "solo", None),
    RequestArrived(step=4, time_s=2.0, request_id="a#1", job_id="a", num_prompt_tokens=30,
                   is_last_turn=True),
    RequestArrived(step=4, time_s=2.0, request_id="c#0", job_id="c", num_prompt_tokens=10),
    _snapshot(4, 2.0),
    _admit(4, 2.0, "c#0", "c", prompt=10, hit=0),
    _decision(4, 2.0, {"b#0": 1, "c#0": 10}, new_ids=["c#0"]),
    _snapshot(5, 2.5),
    PinReleased(step=5, time_s=2.5, job_id="a", request_id="a#0", num_blocks=5, ttl_s=2.0,
                held_s=1.5, reason="reused"),
    _admit(5, 2.5, "a#1", "a", prompt=30, hit=24, pin_hit=20),
    _decision(5, 2.5, {"a#1": 6, "c#0": 1}, new_ids=["a#1"]),
    _finish(5, 2.5, "c#0", "c"),
    PinDeclined(step=5, time_s=2.5, job_id="c", request_id="c#0",
                inputs=TTLInputs(ttl_s=0.0, source="cold-start")),
    RequestArrived(step=6, time_s=2.8, request_id="c#1", job_id="c", num_prompt_tokens=12),
    _snapshot(6, 3.0),
    _decision(6, 3.0, {"a#1": 1, "b#0": 1}),
    _finish(6, 3.0, "b#0", "b"),
    JobEnded(step=6, time_s=3.0, job_id="b", reason="job_end"),
    _finish(6, 3.0, "a#1", "a"),
    JobEnded(step=6, time_s=3.0, job_id="a", reason="job_end"),
]


@pytest.fixture
def summary(tmp_path: Path) -> TraceSummary:
    return summarize(read_trace(write_trace(tmp_path / "hand.jsonl", HAND_BUILT)))


def test_request_and_job_figures(summary: TraceSummary) -> None:
    assert (summary.num_steps, summary.duration_s) == (7, 3.0)
    assert summary.num_requests == 6
    assert summary.finished == {"length": 1, "stop": 4}
    assert summary.num_jobs == 3
    jobs = {job.job_id: job for job in summary.jobs}
    assert jobs["a"].completion_s == 3.0 and jobs["b"].completion_s == 2.5
    assert jobs["c"].completion_s is None  # c#1 never finished
    assert summary.job_completion_s == Distribution(
        count=2, mean=2.75, p50=2.5, p90=3.0, p99=3.0, max=3.0)
    assert (jobs["a"].queueing_s, jobs["a"].pin_hit_tokens, jobs["a"].hit_tokens) == (0.5, 20, 24)
    assert (jobs["b"].num_preemptions, jobs["b"].prompt_tokens) == (1, 12)


def test_a_job_cut_short_by_an_abort_has_no_completion(tmp_path: Path) -> None:
    # A run stopped mid-turn: the engine aborts the last turn and ends the job.
    events = [RequestArrived(step=0, time_s=0.0, request_id="d#0", job_id="d",
                             num_prompt_tokens=4, is_last_turn=True),
              _finish(1, 2.0, "d#0", "d", reason="abort"),
              JobEnded(step=1, time_s=2.0, job_id="d", reason="job_end")]
    summary = summarize(read_trace(write_trace(tmp_path / "cut.jsonl", events)))
    assert summary.jobs[0].completion_s is None
    assert summary.job_completion_s.count == 0 and summary.finished == {"abort": 1}


def test_turn_queueing_runs_from_arrival_to_first_admission(summary: TraceSummary) -> None:
    # a#0 0, solo 0.5, b#0 0 (its readmission does not count), c#0 0, a#1 0.5; c#1 never.
    assert summary.turn_queueing_s == Distribution(
        count=5, mean=0.2, p50=0.0, p90=0.5, p99=0.5, max=0.5)


def test_prefix_cache_hits_are_split_between_pins_and_ordinary_cache(
    summary: TraceSummary,
) -> None:
    cache = summary.prefix_cache
    # First admissions: a#0 20/0, solo 5/4, b#0 12/0, c#0 10/0, a#1 30/24 (20 from a's pin).
    assert (cache.prompt_tokens, cache.hit_tokens, cache.pin_hit_tokens) == (77, 28, 20)
    assert cache.hit_rate == pytest.approx(28 / 77)
    assert cache.from_pins == pytest.approx(20 / 77)
    assert cache.from_cache == pytest.approx(8 / 77)


def test_pins_preemptions_and_recomputation(summary: TraceSummary) -> None:
    pins = summary.pins
    assert (pins.num_pinned, pins.num_declined, pins.num_live_at_end) == (1, 1, 0)
    assert pins.released == {"reused": 1}
    assert pins.ttl_s == Distribution(count=1, mean=2.0, p50=2.0, p90=2.0, p99=2.0, max=2.0)
    assert pins.held_s.mean == 1.5
    assert summary.preemptions == 1
    assert summary.recomputed_tokens == 12 - 4  # dropped by the preemption, minus the hit
    assert summary.scheduled_tokens == 20 + 14 + 1 + 10 + 11 + 7 + 2


def test_scalars_table_and_comparison(summary: TraceSummary) -> None:
    scalars = summary.scalars()
    assert scalars["prefix_cache.pin_hit_tokens"] == 20
    assert scalars["pins.released.reused"] == 1
    assert "jobs" not in scalars and "policy" not in scalars
    text = render(summary)
    assert "job_completion_s.mean" in text and "slowest jobs" in text
    assert text.index("\na ") < text.index("\nb ")  # slowest first
    rows = compare(summary, summary)
    assert rows["job_completion_s.mean"] == {"a": 2.75, "b": 2.75, "b_over_a": 1.0}
    assert rows["preemptions"]["b_over_a"] == 1.0
    assert rows["turn_queueing_s.p50"]["b_over_a"] is None  # A is 0


def test_an_empty_trace_summarizes_to_zeros(tmp_path: Path) -> None:
    summary = summarize(read_trace(write_trace(tmp_path / "empty.jsonl", [])))
    assert (summary.num_steps, summary.num_jobs, summary.duration_s) == (0, 0, 0.0)
    assert summary.job_completion_s == Distribution(count=0)
    assert summary.prefix_cache.hit_rate is None
    json.dumps(summary.scalars())


# With a host KV tier (block size 4): h#0 finishes and its 3 blocks are stored; h#1 hits
# 4 tokens on its job's pin, 4 on other device blocks and 12 loaded from the host tier (3
# blocks); g#0 is preempted and its readmission loads 2 blocks, which are copies but not a
# first admission's hits.
WITH_HOST_TIER = [
    RequestArrived(step=0, time_s=0.0, request_id="h#0", job_id="h", num_prompt_tokens=12),
    _admit(0, 0.0, "h#0", "h", prompt=12, hit=0),
    _decision(0, 0.0, {"h#0": 12}, new_ids=["h#0"]),
    _finish(0, 0.0, "h#0", "h"),
    RequestArrived(step=1, time_s=1.0, request_id="g#0", job_id="g", num_prompt_tokens=8),
    _admit(1, 1.0, "g#0", "g", prompt=8, hit=0),
    _decision(1, 1.0, {"g#0": 8}, new_ids=["g#0"], num_stored_blocks=3),
    RequestArrived(step=2, time_s=2.0, request_id="h#1", job_id="h", num_prompt_tokens=24),
    PrefixCacheEvent(step=2, time_s=2.0, request_id="h#1", job_id="h", num_prompt_tokens=24,
                     num_hit_tokens=20, num_pin_hit_tokens=4, num_host_hit_tokens=12),
    _decision(2, 2.0, {"h#1": 4}, new_ids=["h#1"], num_loaded_blocks=3, preempted=[
        Preemption(request_id="g#0", job_id="g", needed_by="h#1", num_computed_tokens=8)]),
    PrefixCacheEvent(step=3, time_s=3.0, request_id="g#0", job_id="g", num_prompt_tokens=9,
                     num_hit_tokens=8, num_host_hit_tokens=8, resumed=True),
    _decision(3, 3.0, {"h#1": 1, "g#0": 1}, resumed_ids=["g#0"], num_stored_blocks=2,
              num_loaded_blocks=2),
]


@pytest.fixture
def host_summary(tmp_path: Path) -> TraceSummary:
    return summarize(read_trace(write_trace(tmp_path / "host.jsonl", WITH_HOST_TIER)))


def test_hits_are_split_between_pins_device_cache_and_host_tier(
    host_summary: TraceSummary,
) -> None:
    cache = host_summary.prefix_cache
    # First admissions: h#0 12/0, g#0 8/0, h#1 24/20 (4 pin, 4 device, 12 host).
    assert (cache.prompt_tokens, cache.hit_tokens) == (44, 20)
    assert (cache.pin_hit_tokens, cache.device_hit_tokens, cache.host_hit_tokens) == (4, 4, 12)
    assert cache.from_pins == pytest.approx(4 / 44)
    assert cache.from_cache == pytest.approx(4 / 44)
    assert cache.from_host == pytest.approx(12 / 44)
    assert cache.hit_rate == pytest.approx(cache.from_pins + cache.from_cache + cache.from_host)
    jobs = {job.job_id: job for job in host_summary.jobs}
    assert (jobs["h"].hit_tokens, jobs["h"].pin_hit_tokens, jobs["h"].host_hit_tokens) == \
        (20, 4, 12)
    assert jobs["g"].host_hit_tokens == 0  # its readmission's load is not a first admission
    assert host_summary.recomputed_tokens == 0  # the readmission loaded what it lost


def test_host_tier_copies_are_summed_over_the_steps(host_summary: TraceSummary) -> None:
    assert host_summary.host_tier == HostTierSummary(
        stored_blocks=5, loaded_blocks=5, num_steps_storing=2, num_steps_loading=2)
    scalars = host_summary.scalars()
    assert scalars["host_tier.loaded_blocks"] == 5
    assert scalars["prefix_cache.host_hit_tokens"] == 12
    text = render(host_summary)
    assert "prefix_cache.from_host" in text and "host_tier.stored_blocks" in text


def test_hand_built_trace_without_a_tier_has_no_host_figures(summary: TraceSummary) -> None:
    assert summary.prefix_cache.host_hit_tokens == 0
    assert summary.prefix_cache.from_host == 0.0
    assert summary.host_tier == HostTierSummary(
        stored_blocks=0, loaded_blocks=0, num_steps_storing=0, num_steps_loading=0)
    rows = compare(summary, summary)
    assert rows["host_tier.stored_blocks"] == {"a": 0, "b": 0, "b_over_a": None}


def test_a_trace_from_before_the_host_tier_still_summarizes(tmp_path: Path) -> None:
    """Lines as the engine wrote them before `num_host_hit_tokens`, `num_stored_blocks` and
    `num_loaded_blocks` existed."""
    lines = [
        msgspec.json.encode(header()).decode(),
        '{"type":"request_arrived","step":0,"time_s":0.0,"request_id":"r","job_id":"j",'
        '"num_prompt_tokens":8}',
        '{"type":"prefix_cache","step":0,"time_s":0.0,"request_id":"r","job_id":"j",'
        '"num_prompt_tokens":8,"num_hit_tokens":4,"num_pin_hit_tokens":4}',
        '{"type":"step_decision","step":0,"time_s":0.0,"new_ids":["r"],"resumed_ids":[],'
        '"num_scheduled_tokens":{"r":4},"total_num_scheduled_tokens":4}',
    ]
    path = tmp_path / "old.jsonl"
    path.write_text("\n".join(lines) + "\n")
    summary = summarize(read_trace(path))
    cache = summary.prefix_cache
    assert (cache.hit_tokens, cache.pin_hit_tokens) == (4, 4)
    assert (cache.device_hit_tokens, cache.host_hit_tokens) == (0, 0)
    assert summary.host_tier.stored_blocks == summary.host_tier.loaded_blocks == 0
    assert summary.jobs[0].host_hit_tokens == 0
