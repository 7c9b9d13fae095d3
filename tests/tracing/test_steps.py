"""`timed_steps` rebuilds each step's batch and duration from a hand-built trace."""

from __future__ import annotations

from pathlib import Path

from tests.tracing.builders import write_trace
from tests.tracing.test_summary import _admit, _decision, _finish, _snapshot
from tracing.reader import read_trace
from tracing.records import Preemption, RequestArrived
from tracing.steps import TimedStep, timed_steps


def _arrive(step: int, time_s: float, request_id: str, prompt: int) -> RequestArrived:
    return RequestArrived(step=step, time_s=time_s, request_id=request_id,
                          num_prompt_tokens=prompt)


# a: 10 tokens, 4 from the cache. b: 12 tokens, preempted after its first chunk, readmitted
# with 4 cached. Both finish in step 4 and the engine waits for c, which arrives at 5.0 s.
EVENTS = [
    _arrive(0, 0.0, "a", 10), _snapshot(0, 0.0), _admit(0, 0.0, "a", None, 10, 4),
    _decision(0, 0.0, {"a": 6}, new_ids=["a"]),
    _arrive(1, 0.4, "b", 12), _snapshot(1, 0.5), _admit(1, 0.5, "b", None, 12, 0),
    _decision(1, 0.5, {"a": 1, "b": 8}, new_ids=["b"]),
    _snapshot(2, 0.8),
    _decision(2, 0.8, {"a": 1}, preempted=[
        Preemption(request_id="b", needed_by="a", num_computed_tokens=8)]),
    _snapshot(3, 1.0), _admit(3, 1.0, "b", None, 12, 4, resumed=True),
    _decision(3, 1.0, {"a": 1, "b": 8}, resumed_ids=["b"]),
    _snapshot(4, 1.2), _decision(4, 1.2, {"a": 1, "b": 1}),
    _finish(4, 1.2, "a", None), _finish(4, 1.2, "b", None),
    _arrive(5, 5.0, "c", 3), _snapshot(5, 5.0), _admit(5, 5.0, "c", None, 3, 0),
    _decision(5, 5.0, {"c": 3}, new_ids=["c"]),
    _snapshot(6, 5.1), _decision(6, 5.1, {"c": 1}), _finish(6, 5.1, "c", None),
]


def test_batches_durations_and_busy_periods(tmp_path: Path) -> None:
    steps = timed_steps(read_trace(write_trace(tmp_path / "t.jsonl", EVENTS)))
    assert [(s.step, s.batch, s.period, s.index_in_period) for s in steps] == [
        (0, ((4, 6),), 0, 0),
        (1, ((10, 1), (0, 8)), 0, 1),
        (2, ((11, 1),), 0, 2),  # b's 8 tokens were dropped
        (3, ((12, 1), (4, 8)), 0, 3),  # b readmitted on its 4 cached tokens
        (4, ((13, 1), (12, 1)), 0, 4),
        (5, ((0, 3),), 1, 0),
        (6, ((3, 1),), 1, 1),
    ]
    durations = [None if s.duration_s is None else round(s.duration_s, 9) for s in steps]
    # Step 4 left nothing unfinished (the gap to c is idle); step 6 is the last.
    assert durations == [0.5, 0.3, 0.2, 0.2, None, 0.1, None]
    assert all(s.complete for s in steps)


def test_a_request_admitted_before_the_trace_began_marks_its_steps_unknown(
    tmp_path: Path,
) -> None:
    events = [_snapshot(7, 1.0), _decision(7, 1.0, {"old": 1}),
              _snapshot(8, 1.5), _decision(8, 1.5, {"old": 1})]
    steps = timed_steps(read_trace(write_trace(tmp_path / "t.jsonl", events)))
    # Still running when the trace began, so the engine was busy between the two steps.
    assert steps == [TimedStep(7, 1.0, ((0, 1),), 0.5, 0, 0, complete=False),
                     TimedStep(8, 1.5, ((1, 1),), None, 0, 1, complete=False)]
