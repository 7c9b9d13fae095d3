"""How far a run had got by a time: the turns and jobs a trace shows finished by then.

Times count from the trace's first request arrival (a replay's start), on the scheduler
clock. A turn finished when its request finished for any reason but an abort (a run stopped
mid-job aborts its turns in flight); a job finished when its last turn (`is_last_turn`, as
the client said) did.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracing.reader import Trace
from tracing.records import RequestArrived, RequestFinished
from tracing.summary import ABORT_REASON


@dataclass(frozen=True)
class Progress:
    """By `by_s` seconds after the first arrival: `turns_finished`, `last_turns_arrived` (jobs
    that had sent their last turn) and `jobs_finished` (jobs whose last turn finished)."""

    by_s: float
    turns_finished: int
    last_turns_arrived: int
    jobs_finished: int


def first_arrival_s(trace: Trace) -> float:
    """The scheduler clock at the trace's first request arrival; ValueError if none."""
    arrivals = [e.time_s for e in trace.events if isinstance(e, RequestArrived)]
    if not arrivals:
        raise ValueError(f"{trace.path} holds no request arrival")
    return min(arrivals)


def trace_span_s(trace: Trace) -> float:
    """Seconds from the first arrival to the trace's last record (where a stopped run was
    cut)."""
    return trace.events[-1].time_s - first_arrival_s(trace)


def progress_by(trace: Trace, by_s: float) -> Progress:
    """What `trace` finished within `by_s` seconds of its first arrival."""
    deadline_s = first_arrival_s(trace) + by_s
    last_turns = {e.request_id for e in trace.events
                  if isinstance(e, RequestArrived) and e.is_last_turn and e.time_s <= deadline_s}
    finished = {e.request_id for e in trace.events
                if isinstance(e, RequestFinished) and e.reason != ABORT_REASON
                and e.time_s <= deadline_s}
    return Progress(by_s=by_s, turns_finished=len(finished),
                    last_turns_arrived=len(last_turns),
                    jobs_finished=len(last_turns & finished))
