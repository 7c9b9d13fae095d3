"""The scheduler's trace: it changes no decision, and it records every step and event."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from continuum.presets import CONTINUUM
from engine.scheduler.retention import RetentionInputs
from engine.scheduler.tracer import SchedulerTracer, ttl_inputs
from estimator.ttl_estimator import ConstantTTLEstimator
from tests.continuum.harness import Harness, tokens
from tests.continuum.test_properties import AGENT_POLICIES
from tests.continuum.workload import AgentJob, Turn, replay
from tracing.reader import Trace, read_trace
from tracing.records import (
    PinDeclined,
    PinPinned,
    PinReleased,
    PrefixCacheEvent,
    RequestArrived,
    RequestFinished,
    StepDecision,
    StepSnapshot,
    TTLInputs,
)
from tracing.summary import summarize

turn = st.builds(Turn, appended_tokens=st.integers(1, 10), output_tokens=st.integers(1, 14),
                 tool_s=st.sampled_from([0.0, 0.05, 0.3, 1.0]),
                 tool_name=st.sampled_from([None, "bash"]))
job_shape = st.tuples(st.floats(0.0, 0.5), st.lists(turn, min_size=1, max_size=3))


def _jobs(shapes, num_blocks: int) -> list[AgentJob]:
    jobs = []
    for index, (arrival_s, turns) in enumerate(shapes):
        last = Turn(turns[-1].appended_tokens, turns[-1].output_tokens, tool_s=None)
        jobs.append(AgentJob(f"job{index}", arrival_s, (*turns[:-1], last)))
    return [job for job in jobs if job.num_tokens <= num_blocks * 4]


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    policy_name=st.sampled_from(sorted(AGENT_POLICIES)),
    shapes=st.lists(job_shape, min_size=2, max_size=8),
    num_blocks=st.integers(8, 16),
    max_num_seqs=st.integers(2, 6),
    seed=st.integers(0, 100),
)
def test_tracing_changes_no_decision_and_records_every_step(
    tmp_path: Path, policy_name, shapes, num_blocks, max_num_seqs, seed
) -> None:
    jobs = _jobs(shapes, num_blocks)
    if not jobs:
        return
    options = {"num_blocks": num_blocks, "max_num_batched_tokens": 24, "max_num_seqs": max_num_seqs,
               "seed": seed, "max_steps": 20_000}
    untraced = replay(jobs, AGENT_POLICIES[policy_name](jobs), **options)
    path = tmp_path / f"{policy_name}-{seed}.jsonl"
    traced = replay(jobs, AGENT_POLICIES[policy_name](jobs),
                    tracer=SchedulerTracer(path, config={"policy": policy_name}), **options)
    assert traced.steps == untraced.steps
    assert traced.job_completion_s == untraced.job_completion_s
    trace = read_trace(path)
    _check_trace_matches_steps(trace, traced.steps)
    assert summarize(trace).recomputed_tokens == traced.recomputed_tokens
    event(f"preempted: {traced.num_preemptions > 0}")
    event(f"pinned: {traced.num_pins_created > 0}")


def _check_trace_matches_steps(trace: Trace, steps: list[tuple]) -> None:
    """One snapshot then one decision per step, numbered in order, agreeing with what the
    scheduler output; every request arrives once and finishes once."""
    snapshots = [e for e in trace.events if isinstance(e, StepSnapshot)]
    decisions = [e for e in trace.events if isinstance(e, StepDecision)]
    assert [s.step for s in snapshots] == [d.step for d in decisions] == list(range(len(steps)))
    for decision, (admitted, num_scheduled, preempted, _) in zip(decisions, steps, strict=True):
        assert sorted(decision.new_ids + decision.resumed_ids) == sorted(admitted)
        assert decision.num_scheduled_tokens == num_scheduled
        assert sorted(p.request_id for p in decision.preempted) == preempted
        assert decision.total_num_scheduled_tokens == sum(num_scheduled.values())
    current_step = 0
    for record in trace.events:
        assert record.step >= current_step, f"{record} is out of step order"
        current_step = record.step
    arrived = [e.request_id for e in trace.events if isinstance(e, RequestArrived)]
    finished = [e.request_id for e in trace.events if isinstance(e, RequestFinished)]
    assert sorted(arrived) == sorted(finished) and len(set(arrived)) == len(arrived)
    pinned = sum(1 for e in trace.events if isinstance(e, PinPinned))
    released = sum(1 for e in trace.events if isinstance(e, PinReleased))
    assert pinned == released  # every job ended


def _harness(tmp_path: Path, ttl_s: float, **options) -> Harness:
    tracer = SchedulerTracer(tmp_path / "t.jsonl", config={"test": True})
    return Harness(CONTINUUM.build(estimator=ConstantTTLEstimator(ttl_s)), tracer=tracer,
                   **options)


def _recorded(harness: Harness) -> list:
    """Closes the harness's trace and reads its events back."""
    tracer = harness.scheduler.tracer
    assert tracer is not None
    harness.scheduler.close_subscribers()
    return read_trace(tracer.path).events


def test_a_reused_pin_is_recorded_with_the_hit_it_gave(tmp_path: Path) -> None:
    harness = _harness(tmp_path, ttl_s=5.0)
    harness.add("j#0", tokens(100, 14), job="j", tool="ls", max_tokens=3)
    harness.run_until_finished("j#0")
    harness.step(dt_s=0.5)
    harness.next_turn("j#1", "j#0", tokens(500, 4), last=True)
    harness.run_until_finished("j#1")
    events = _recorded(harness)
    pinned = next(e for e in events if isinstance(e, PinPinned))
    assert (pinned.job_id, pinned.request_id, pinned.ttl_s) == ("j", "j#0", 5.0)
    assert pinned.num_blocks == 4  # 14 + 3 tokens, the last one's KV never computed
    assert pinned.inputs is not None and pinned.inputs.source == "constant"
    assert pinned.inputs.tool == "ls"
    second = next(e for e in events if isinstance(e, PrefixCacheEvent) and e.request_id == "j#1")
    assert (second.num_hit_tokens, second.num_pin_hit_tokens) == (16, 16)
    released = next(e for e in events if isinstance(e, PinReleased))
    assert released.reason == "reused" and released.step == second.step
    assert released.held_s == pytest.approx(released.time_s - pinned.time_s)


def test_a_declined_pin_records_why(tmp_path: Path) -> None:
    harness = _harness(tmp_path, ttl_s=0.0)
    harness.add("j#0", tokens(100, 9), job="j", max_tokens=2)
    harness.run_until_finished("j#0")
    events = _recorded(harness)
    declined = [e for e in events if isinstance(e, PinDeclined)]
    assert len(declined) == 1 and not any(isinstance(e, PinPinned) for e in events)
    assert (declined[0].request_id, declined[0].inputs.ttl_s) == ("j#0", 0.0)


def test_preemptions_name_their_cause_and_readmissions_are_marked(tmp_path: Path) -> None:
    harness = _harness(tmp_path, ttl_s=0.0, num_blocks=6, block_size=4, max_model_len=24)
    harness.add("old", tokens(100, 8), max_tokens=12)
    harness.add("young", tokens(200, 8), max_tokens=12)
    harness.run_until_finished("old", "young")
    events = _recorded(harness)
    preemptions = [p for e in events if isinstance(e, StepDecision) for p in e.preempted]
    assert preemptions and preemptions[0].request_id == "young"
    assert preemptions[0].needed_by == "old" and preemptions[0].num_computed_tokens > 0
    readmission = [e for e in events if isinstance(e, PrefixCacheEvent) and e.resumed]
    assert [e.request_id for e in readmission] == ["young"]
    decision = next(e for e in events if isinstance(e, StepDecision)
                    and e.step == readmission[0].step)
    assert decision.resumed_ids == ["young"] and decision.new_ids == []
    finished = {e.request_id: e for e in events if isinstance(e, RequestFinished)}
    assert finished["young"].num_preemptions == len(preemptions)


@pytest.mark.parametrize(("num_blocks", "young_prompt", "dropped", "hit"), [
    (6, tokens(200, 8), [12], [4]),  # readmitted with one block of its prefix still cached
    (7, tokens(100, 12), [16, 20], [16, 20]),  # old's prompt: old holds its blocks
])
def test_recomputed_tokens_count_as_the_trace_summary_does(
    tmp_path: Path, num_blocks: int, young_prompt: list[int], dropped: list[int], hit: list[int],
) -> None:
    harness = _harness(tmp_path, ttl_s=0.0, num_blocks=num_blocks, block_size=4,
                       max_model_len=4 * num_blocks)
    harness.add("old", tokens(100, len(young_prompt)), max_tokens=12)
    harness.add("young", young_prompt, max_tokens=12)
    harness.run_until_finished("old", "young")
    scheduler = harness.scheduler
    trace_path = scheduler.tracer.path
    events = _recorded(harness)
    assert [p.num_computed_tokens for e in events if isinstance(e, StepDecision)
            for p in e.preempted] == dropped
    assert [e.num_hit_tokens for e in events
            if isinstance(e, PrefixCacheEvent) and e.resumed] == hit
    expected = sum(max(0, d - h) for d, h in zip(dropped, hit, strict=True))
    assert scheduler.recomputed_tokens == summarize(read_trace(trace_path)).recomputed_tokens
    assert scheduler.recomputed_tokens == expected


def test_events_between_steps_carry_the_next_steps_number(tmp_path: Path) -> None:
    harness = _harness(tmp_path, ttl_s=0.0)
    harness.add("a", tokens(1, 5), max_tokens=1)
    harness.step()
    harness.add("b", tokens(50, 5), max_tokens=1)
    harness.scheduler.finish_requests(["b"])
    events = _recorded(harness)
    steps = {(type(e).__name__, getattr(e, "request_id", None)): e.step for e in events}
    assert steps[("RequestArrived", "a")] == 0
    assert steps[("RequestFinished", "a")] == 0  # finished by step 0's output
    assert steps[("RequestArrived", "b")] == steps[("RequestFinished", "b")] == 1
    abort = next(e for e in events if isinstance(e, RequestFinished) and e.request_id == "b")
    assert abort.reason == "abort"


def test_a_trace_that_cannot_be_written_is_dropped_and_scheduling_goes_on(caplog) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    jobs = [AgentJob("j", 0.0, (Turn(6, 3, 0.1), Turn(4, 2, None)))]
    untraced = replay(jobs, CONTINUUM.build(estimator=ConstantTTLEstimator(1.0)), num_blocks=16)
    traced = replay(jobs, CONTINUUM.build(estimator=ConstantTTLEstimator(1.0)), num_blocks=16,
                    tracer=SchedulerTracer("/dev/full"))
    assert traced.steps == untraced.steps
    assert "tracing is disabled" in caplog.text


def test_an_idle_sweep_records_the_pins_it_releases_and_no_step(tmp_path: Path) -> None:
    harness = _harness(tmp_path, ttl_s=2.0)
    harness.add("j#0", tokens(100, 9), job="j", max_tokens=2)
    harness.run_until_finished("j#0")
    path = harness.scheduler.tracer.path
    num_steps = harness.scheduler.step_id
    before = Path(path).read_bytes()
    for _ in range(5):  # sweeps with nothing due write nothing
        harness.clock.advance(0.1)
        assert not harness.scheduler.sweep()
    assert Path(path).read_bytes() == before
    harness.clock.advance(2.0)
    assert harness.scheduler.sweep().released_pins  # flushed at once, without a step
    events = read_trace(path).events
    released = [e for e in events if isinstance(e, PinReleased)]
    assert [(e.job_id, e.reason, e.step) for e in released] == [("j", "expired", num_steps)]
    assert released[0].time_s == harness.clock() and released[0].held_s == pytest.approx(2.5)
    snapshots = [e for e in events if isinstance(e, StepSnapshot)]
    assert len(snapshots) == num_steps  # the sweep recorded no step
    assert harness.scheduler.sweep().forgotten_job_ids == ()  # the job's timeout is 600 s
    assert read_trace(path).events == events


def test_a_policys_retention_inputs_are_written_field_for_field() -> None:
    # The policy interface's type and the trace's record must keep the same fields.
    names = [field.name for field in dataclasses.fields(RetentionInputs)]
    assert names == list(TTLInputs.__struct_fields__)
    values = dict(zip(names, (1.5, "tool", "ls", 7, 0.25, 0.5, 2.0, 2.5, "pin-cap", 0.75),
                      strict=True))
    assert ttl_inputs(RetentionInputs(**values)) == TTLInputs(**values)
