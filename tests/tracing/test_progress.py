"""`progress_by`: what a trace finished by a time, counted from its first arrival."""

from __future__ import annotations

from pathlib import Path

from tests.tracing.builders import write_trace
from tests.tracing.test_summary import _finish
from tracing.progress import Progress, progress_by, trace_span_s
from tracing.reader import read_trace
from tracing.records import RequestArrived


def _arrive(time_s: float, request_id: str, job_id: str, *, last: bool) -> RequestArrived:
    return RequestArrived(step=0, time_s=time_s, request_id=request_id, job_id=job_id,
                          num_prompt_tokens=8, is_last_turn=last)


# Job a's two turns finish at 11 s and 13 s; job b's only turn is aborted when the run stops.
EVENTS = [
    _arrive(10.0, "a#0", "a", last=False), _arrive(10.5, "b#0", "b", last=True),
    _finish(0, 11.0, "a#0", "a"), _arrive(11.5, "a#1", "a", last=True),
    _finish(0, 13.0, "a#1", "a"), _finish(0, 14.0, "b#0", "b", reason="abort"),
]


def test_turns_and_jobs_finished_by_a_time(tmp_path: Path) -> None:
    trace = read_trace(write_trace(tmp_path / "t.jsonl", EVENTS))
    assert trace_span_s(trace) == 4.0
    assert progress_by(trace, 1.0) == Progress(1.0, turns_finished=1, last_turns_arrived=1,
                                               jobs_finished=0)
    assert progress_by(trace, 2.0) == Progress(2.0, turns_finished=1, last_turns_arrived=2,
                                               jobs_finished=0)
    # An aborted turn finishes nothing: b never did.
    assert progress_by(trace, 4.0) == Progress(4.0, turns_finished=2, last_turns_arrived=2,
                                               jobs_finished=1)
