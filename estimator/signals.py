"""The two load signals of Eq. 2's benefit `T * eta + R`: the queueing delay `T` that turns
returning without their KV suffered, and `eta`, how strongly a job's progress predicts the
turns it has left."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable


class SlidingMean:
    """The mean of the latest `window` values (None before the first)."""

    def __init__(self, window: int = 256) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._values: deque[float] = deque(maxlen=window)

    def add(self, value: float) -> None:
        self._values.append(value)

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
    per job in closed form, so an update costs O(1). `default` (1, the cold-start assumption)
    applies while the correlation is undefined.
    """

    def __init__(self, max_jobs: int = 10_000, default: float = 1.0) -> None:
        if max_jobs < 1:
            raise ValueError(f"max_jobs must be >= 1, got {max_jobs}")
        self.default = default
        self._num_turns: deque[int] = deque()
        self.max_jobs = max_jobs
        self._sums = [0.0] * 4  # count, sum k, sum k^2, sum k(N-k)

    def add(self, num_turns: int) -> None:
        """A job ended after `num_turns` turns."""
        if num_turns < 0:
            raise ValueError(f"num_turns must be >= 0, got {num_turns}")
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
        sum_k = m * (m + 1) / 2
        sum_k2 = m * (m + 1) * (2 * m + 1) / 6
        for index, value in enumerate((m, sum_k, sum_k2, num_turns * sum_k - sum_k2)):
            self._sums[index] += sign * value

    @property
    def eta(self) -> float:
        count, sum_k, sum_k2, sum_k_rest = self._sums
        if count < 2:
            return self.default
        # N - k ranges over the same values as k within each job, so both variances match.
        variance = sum_k2 / count - (sum_k / count) ** 2
        if variance <= 1e-12:
            return self.default
        covariance = sum_k_rest / count - (sum_k / count) ** 2
        return max(-1.0, min(1.0, -covariance / variance))

    @property
    def num_turns(self) -> list[int]:
        return list(self._num_turns)

    def __len__(self) -> int:
        return len(self._num_turns)
