"""The load signals of Eq. 2: the queueing delay `T` that turns returning without their KV
suffered, `eta`, how strongly a job's progress predicts the turns it has left (the benefit
`T * eta + R`)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

from estimator.ttl_estimator import MAX_JOB_TURNS, MAX_OBSERVED_S, clamp_seconds


class SlidingMean:
    """The mean of the latest `window` values, in seconds (None before the first).

    Values are clamped into [0, `max_value_s`] and NaN is ignored, so the sum of the window
    stays far from overflowing whatever is added.
    """

    def __init__(self, window: int = 256, max_value_s: float = MAX_OBSERVED_S) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if not (0 < max_value_s <= MAX_OBSERVED_S):
            raise ValueError(f"max_value_s must be in (0, {MAX_OBSERVED_S}], got {max_value_s}")
        self.max_value_s = float(max_value_s)
        self._values: deque[float] = deque(maxlen=window)

    def add(self, value_s: float) -> None:
        clamped = clamp_seconds(value_s)
        if clamped is not None:
            self._values.append(min(clamped, self.max_value_s))

    @property
    def window(self) -> int:
        return self._values.maxlen or 1

    @property
    def mean(self) -> float | None:
        # Summed afresh (exactly): a running total would keep the rounding error of values
        # long gone from the window.
        return math.fsum(self._values) / len(self._values) if self._values else None

    @property
    def values(self) -> list[float]:
        return list(self._values)

    def __len__(self) -> int:
        return len(self._values)


class RemainingTurnsCorrelation:
    """`eta = -corr(k, N - k)` over the pin decisions of finished jobs, clipped to [-1, 1].

    A job of N turns makes a decision after each of its first N - 1 turns, with k = 1 .. N - 1
    turns done and N - k to go. When every job has the same length the two are perfectly
    anti-correlated (eta = 1: a turn that waits delays all the job's remaining work); the more
    lengths vary, the less k says about N - k. The latest `max_jobs` jobs count; sums are kept
    per job in closed form as exact integers, so an update costs O(1) and no rounding
    accumulates. `default` (1, the cold-start assumption) applies while the correlation is
    undefined. Job lengths are at most `MAX_JOB_TURNS`, which keeps every sum far from a
    float's range when `eta` divides them.
    """

    def __init__(self, max_jobs: int = 10_000, default: float = 1.0) -> None:
        if max_jobs < 1:
            raise ValueError(f"max_jobs must be >= 1, got {max_jobs}")
        self.default = default
        self._num_turns: deque[int] = deque()
        self.max_jobs = max_jobs
        self._sums = [0] * 4  # count, sum k, sum k^2, sum k(N-k)

    def add(self, num_turns: int) -> None:
        """A job ended after `num_turns` turns; ValueError unless 0 <= num_turns <=
        `MAX_JOB_TURNS` (callers clamp what they observe)."""
        if not 0 <= num_turns <= MAX_JOB_TURNS:
            raise ValueError(f"num_turns must be in [0, {MAX_JOB_TURNS}], got {num_turns}")
        num_turns = int(num_turns)
        self._num_turns.append(num_turns)
        self._accumulate(num_turns, +1)
        if len(self._num_turns) > self.max_jobs:
            self._accumulate(self._num_turns.popleft(), -1)

    def extend(self, num_turns: Iterable[int]) -> None:
        for value in num_turns:
            self.add(value)

    def _accumulate(self, num_turns: int, sign: int) -> None:
        m = num_turns - 1  # decisions made: k = 1 .. m
        if m < 1:
            return
        sum_k = m * (m + 1) // 2
        sum_k2 = m * (m + 1) * (2 * m + 1) // 6
        for index, value in enumerate((m, sum_k, sum_k2, num_turns * sum_k - sum_k2)):
            self._sums[index] += sign * value

    @property
    def eta(self) -> float:
        count, sum_k, sum_k2, sum_k_rest = self._sums
        if count < 2:
            return self.default
        # count^2 times Var(k) and Cov(k, N - k), exactly; N - k ranges over the same values
        # as k within each job, so both variances match and the ratio lies in [-1, 1].
        variance = count * sum_k2 - sum_k * sum_k
        if variance <= 0:
            return self.default
        covariance = count * sum_k_rest - sum_k * sum_k
        return max(-1.0, min(1.0, -covariance / variance))

    @property
    def num_turns(self) -> list[int]:
        return list(self._num_turns)

    def __len__(self) -> int:
        return len(self._num_turns)
