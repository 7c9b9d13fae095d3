"""Job arrival processes: when each job's first turn is sent, in seconds from the start."""

from __future__ import annotations

import random


def poisson_arrivals_s(num_jobs: int, jobs_per_s: float, *, seed: int = 0) -> list[float]:
    """Arrival times of a Poisson process at `jobs_per_s`, the first job at 0 s; the same
    seed gives the same times."""
    if num_jobs < 0:
        raise ValueError(f"num_jobs must be >= 0, got {num_jobs}")
    if not jobs_per_s > 0 or jobs_per_s == float("inf"):
        raise ValueError(f"jobs_per_s must be a positive number, got {jobs_per_s!r}")
    rng = random.Random(seed)
    times = []
    now_s = 0.0
    for index in range(num_jobs):
        if index > 0:
            now_s += rng.expovariate(jobs_per_s)
        times.append(now_s)
    return times


def all_at_once_arrivals_s(num_jobs: int) -> list[float]:
    """Every job at 0 s (a closed batch)."""
    if num_jobs < 0:
        raise ValueError(f"num_jobs must be >= 0, got {num_jobs}")
    return [0.0] * num_jobs


def arrivals_s(num_jobs: int, jobs_per_s: float | None, *, seed: int = 0) -> list[float]:
    """Poisson at `jobs_per_s`, or all at once when it is None."""
    if jobs_per_s is None:
        return all_at_once_arrivals_s(num_jobs)
    return poisson_arrivals_s(num_jobs, jobs_per_s, seed=seed)


def poisson_arrivals_within_s(window_s: float, per_s: float, *, seed: int = 0) -> list[float]:
    """The arrivals of `poisson_arrivals_s(..., per_s, seed=seed)` that fall within
    `[0, window_s]` seconds: at least the first, at 0 s."""
    if not per_s > 0 or per_s == float("inf"):
        raise ValueError(f"the rate must be a positive number, got {per_s!r}")
    rng = random.Random(seed)
    times = [0.0]
    while (now_s := times[-1] + rng.expovariate(per_s)) <= window_s:
        times.append(now_s)
    return times
