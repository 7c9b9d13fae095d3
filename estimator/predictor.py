"""What a duration predictor sees of a tool call, and the interface a learned one implements."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from estimator.solver import DurationCDF
from estimator.ttl_estimator import (
    MAX_CONTEXT_TOKENS,
    MAX_JOB_TURNS,
    MAX_OBSERVED_S,
    clamp_count,
    clamp_seconds,
)

Number = TypeVar("Number", int, float)

RECENT_CALLS_PER_JOB = 8


@dataclass(frozen=True, slots=True)
class CallFeatures:
    """A tool call as a predictor sees it: the tool, where the job is, and the job's latest
    tool calls (`recent`: (tool name, duration in seconds), oldest first).

    `bounded` builds one with every number within the estimator's bounds
    (`estimator.ttl_estimator`); `from_list` refuses one outside them.
    """

    tool_name: str | None
    turn_index: int
    num_context_tokens: int
    recent: tuple[tuple[str | None, float], ...] = ()

    @classmethod
    def bounded(cls, tool_name: str | None, turn_index: int, num_context_tokens: int,
                recent: tuple[tuple[str | None, float], ...] = ()) -> CallFeatures:
        """Features of an observed call, its counts clamped into their bounds (`recent`
        comes from `RecentCalls`, already bounded)."""
        return cls(tool_name, clamp_count(turn_index, MAX_JOB_TURNS),
                   clamp_count(num_context_tokens, MAX_CONTEXT_TOKENS), recent)

    def to_list(self) -> list:
        return [self.tool_name, self.turn_index, self.num_context_tokens,
                [list(item) for item in self.recent]]

    @classmethod
    def from_list(cls, data: Sequence) -> CallFeatures:
        """The inverse of `to_list`; ValueError if a number is out of bounds."""
        tool_name, turn_index, num_context_tokens, recent = data
        if len(recent) > RECENT_CALLS_PER_JOB:
            raise ValueError(f"more than {RECENT_CALLS_PER_JOB} recent calls")
        return cls(
            None if tool_name is None else str(tool_name),
            _bounded_int(turn_index, MAX_JOB_TURNS),
            _bounded_int(num_context_tokens, MAX_CONTEXT_TOKENS),
            tuple((None if name is None else str(name), bounded_duration_s(d))
                  for name, d in recent),
        )


def bounded_duration_s(value: object) -> float:
    """A saved duration in seconds; ValueError unless it is a number in [0,
    `MAX_OBSERVED_S`]."""
    return _bounded(value, float, MAX_OBSERVED_S, "duration")


def _bounded_int(value: object, maximum: int) -> int:
    return _bounded(value, int, maximum, "count")


def _bounded(value: object, kind: Callable[[Any], Number], maximum: float, what: str) -> Number:
    """`kind(value)`, a number in [0, `maximum`]; ValueError naming `what` otherwise."""
    try:
        number = kind(value)
    except (TypeError, OverflowError) as error:
        raise ValueError(f"bad {what} {value!r}: {error}") from error
    if not 0 <= number <= maximum:
        raise ValueError(f"{what} {value!r} is not in [0, {maximum}]")
    return number


@dataclass(frozen=True, slots=True)
class DurationRecord:
    """A finished tool call: what was known when it started, and how long it took."""

    features: CallFeatures
    duration_s: float


class DurationPredictor(Protocol):
    """A conditional distribution of a tool call's duration, given its features."""

    @property
    def is_fitted(self) -> bool: ...

    def fit(self, records: Sequence[DurationRecord]) -> None:
        """Trains on finished calls (replacing what was learned before)."""
        ...

    def predict_cdf(self, features: CallFeatures) -> DurationCDF:
        """The predicted CDF; only called once fitted."""
        ...

    def unfitted_copy(self) -> DurationPredictor:
        """A new, unfitted predictor with the same settings (to train aside and swap in)."""
        ...


class RecentCalls:
    """The latest tool calls of each live job, for predictor features; forgets ended jobs and,
    beyond `max_jobs`, the least recently active."""

    def __init__(self, max_jobs: int = 100_000) -> None:
        self.max_jobs = max_jobs
        self._by_job: OrderedDict[str, deque[tuple[str | None, float]]] = OrderedDict()

    def add(self, job_id: str, tool_name: str | None, duration_s: float) -> None:
        """The job's latest tool call took `duration_s` (clamped like every observed
        duration; NaN is ignored)."""
        clamped = clamp_seconds(duration_s)
        if clamped is None:
            return
        calls = self._by_job.pop(job_id, None)
        if calls is None:
            calls = deque(maxlen=RECENT_CALLS_PER_JOB)
        calls.append((tool_name, round(clamped, 6)))  # stable across clock arithmetic
        self._by_job[job_id] = calls
        if len(self._by_job) > self.max_jobs:
            self._by_job.popitem(last=False)

    def of(self, job_id: str) -> tuple[tuple[str | None, float], ...]:
        return tuple(self._by_job.get(job_id, ()))

    def forget(self, job_id: str) -> None:
        self._by_job.pop(job_id, None)

    def __len__(self) -> int:
        return len(self._by_job)
