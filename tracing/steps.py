"""Each step of a trace as a timed batch: what the model computed, and how long the step took.

A step's batch is, per scheduled request, `(num_computed_tokens, num_new_tokens)`: the tokens
whose KV existed entering the step and the tokens computed in it (the pairs a cost profile's
`step_time_s` prices). It is rebuilt from the events alone: an admission (`prefix_cache`)
sets a request's computed tokens to its prefix-cache hit, every step adds what it scheduled,
a preemption drops them.

A step's duration runs from its snapshot to the next step's snapshot (scheduling, the
forward pass and applying its output: everything the engine loop does for the step). It is a
sample of the step's cost only when the engine was busy in between: a step after which no
request was unfinished left the engine waiting for work, so the gap to the next snapshot is
idle time, not step time. Consecutive busy steps form a busy period; a period starts at the
first step, or at the first step after an idle gap. With async scheduling (the trace header's
`scheduler.async_scheduling`) a step's snapshot is taken while the step before still runs on
the device, so the gap after it is mostly that step's device time: such durations are not
the step's own (`bench calibrate` refuses those traces).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from tracing.reader import Trace
from tracing.records import (
    PrefixCacheEvent,
    RequestArrived,
    RequestFinished,
    StepDecision,
    StepSnapshot,
)


@dataclass(frozen=True)
class TimedStep:
    """One step: its number, when its snapshot was taken (`started_s`, the scheduler clock),
    its batch (`(num_computed_tokens, num_new_tokens)` per scheduled request), its
    `duration_s` (None: the engine went idle after it, or the trace ends), the busy period it
    belongs to (`period`, from 0) and its rank in that period (`index_in_period`, from 0).
    `complete` is False when a scheduled request's computed tokens are unknown (admitted
    before the trace began); the batch then counts what the trace shows of them."""

    step: int
    started_s: float
    batch: tuple[tuple[int, int], ...]
    duration_s: float | None
    period: int
    index_in_period: int
    complete: bool = True

    @property
    def num_new_tokens(self) -> int:
        return sum(num_new for _, num_new in self.batch)


@dataclass
class _Walk:
    """The state while walking a trace's events once."""

    computed: dict[str, int] = field(default_factory=dict)
    unknown: set[str] = field(default_factory=set)  # admitted before the trace began
    unfinished: set[str] = field(default_factory=set)
    arrived_since_decision: set[str] = field(default_factory=set)
    planned: list[tuple[StepSnapshot, tuple[tuple[int, int], ...], bool]] = field(
        default_factory=list)
    idle_after: set[int] = field(default_factory=set)
    snapshot: StepSnapshot | None = None


def timed_steps(trace: Trace) -> list[TimedStep]:
    """Every step of `trace` that scheduled anything, in order, with its batch, duration and
    busy period."""
    walk = _Walk()
    for event in trace.events:
        if isinstance(event, RequestArrived):
            walk.unfinished.add(event.request_id)
            walk.arrived_since_decision.add(event.request_id)
        elif isinstance(event, RequestFinished):
            walk.unfinished.discard(event.request_id)
            walk.unknown.discard(event.request_id)
            walk.computed.pop(event.request_id, None)
        elif isinstance(event, StepSnapshot):
            _snapshot(walk, event)
        elif isinstance(event, PrefixCacheEvent):
            walk.computed[event.request_id] = event.num_hit_tokens
            walk.unknown.discard(event.request_id)
        elif isinstance(event, StepDecision) and walk.snapshot is not None:
            _decision(walk, event)
    return list(_timed(walk))


def _snapshot(walk: _Walk, snapshot: StepSnapshot) -> None:
    previous = walk.snapshot
    left_over = walk.unfinished - walk.arrived_since_decision
    if previous is not None and not left_over:
        walk.idle_after.add(previous.step)
    walk.snapshot = snapshot


def _decision(walk: _Walk, decision: StepDecision) -> None:
    for preemption in decision.preempted:
        walk.computed.pop(preemption.request_id, None)
    batch = []
    for request_id, num_new in decision.num_scheduled_tokens.items():
        if request_id not in walk.computed:
            walk.unknown.add(request_id)
        num_computed = walk.computed.get(request_id, 0)
        batch.append((num_computed, num_new))
        walk.computed[request_id] = num_computed + num_new
    walk.unfinished.update(decision.num_scheduled_tokens)
    complete = walk.unknown.isdisjoint(decision.num_scheduled_tokens)
    walk.arrived_since_decision.clear()
    snapshot = walk.snapshot
    assert snapshot is not None
    walk.planned.append((snapshot, tuple(batch), complete))


def _timed(walk: _Walk) -> Iterator[TimedStep]:
    """The planned steps with their durations and periods, less those that scheduled
    nothing."""
    period = -1
    index_in_period = 0
    ends = [snapshot.time_s for snapshot, _, _ in walk.planned[1:]] + [None]
    busy_before = False
    for (snapshot, batch, complete), end_s in zip(walk.planned, ends, strict=True):
        if busy_before:
            index_in_period += 1
        else:
            period += 1
            index_in_period = 0
        busy = end_s is not None and snapshot.step not in walk.idle_after
        if batch:
            yield TimedStep(snapshot.step, snapshot.time_s, batch,
                            end_s - snapshot.time_s if busy else None, period,
                            index_in_period, complete)
        busy_before = busy
