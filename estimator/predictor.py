"""What a duration predictor sees of a tool call, and the interface a learned one implements."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from estimator.solver import DurationCDF

RECENT_CALLS_PER_JOB = 8


@dataclass(frozen=True, slots=True)
class CallFeatures:
    """A tool call as a predictor sees it: the tool, where the job is, and the job's latest
    tool calls (`recent`: (tool name, duration in seconds), oldest first)."""

    tool_name: str | None
    turn_index: int
    num_context_tokens: int
    recent: tuple[tuple[str | None, float], ...] = ()

    def to_list(self) -> list:
        return [self.tool_name, self.turn_index, self.num_context_tokens,
                [list(item) for item in self.recent]]

    @classmethod
    def from_list(cls, data: Sequence) -> CallFeatures:
        tool_name, turn_index, num_context_tokens, recent = data
        return cls(
            None if tool_name is None else str(tool_name), int(turn_index),
            int(num_context_tokens),
            tuple((None if name is None else str(name), float(d)) for name, d in recent),
        )


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
        calls = self._by_job.pop(job_id, None)
        if calls is None:
            calls = deque(maxlen=RECENT_CALLS_PER_JOB)
        calls.append((tool_name, round(duration_s, 6)))  # stable across clock arithmetic
        self._by_job[job_id] = calls
        if len(self._by_job) > self.max_jobs:
            self._by_job.popitem(last=False)

    def of(self, job_id: str) -> tuple[tuple[str | None, float], ...]:
        return tuple(self._by_job.get(job_id, ()))

    def forget(self, job_id: str) -> None:
        self._by_job.pop(job_id, None)

    def __len__(self) -> int:
        return len(self._by_job)
