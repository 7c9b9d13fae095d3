"""Per-job books of job-aware policies, bounded by an idle timeout."""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from engine.scheduler.policy import JobBooks


@dataclass(slots=True)
class Job:
    """What a policy knows of one agent job. Times are seconds on the scheduler's clock.

    `first_arrival_order` ranks jobs by the arrival of their first turn (smaller is older).
    `attained_service_tokens` counts the tokens the job's finished turns computed, and
    `attained_service_s` the engine seconds they took as the ledger's `ServiceCost` prices
    them.
    `last_ttl_s` is the TTL of the job's latest pin; `last_tool_name` the tool its latest
    finished turn called, as the policy understood it (None: unknown or none).
    """

    job_id: str
    first_arrival_order: int
    first_arrival_s: float
    last_active_s: float
    num_turns_arrived: int = 0
    num_turns_finished: int = 0
    num_unfinished_turns: int = 0
    num_pins_created: int = 0
    pins_released: Counter[str] = field(default_factory=Counter)
    last_ttl_s: float | None = None
    last_tool_name: str | None = None
    attained_service_tokens: int = 0
    attained_service_s: float = 0.0

    def books(self) -> JobBooks:
        """What `GET /v1/jobs/{job_id}` shows of the policy's books, JSON-ready."""
        return {
            "first_arrival_s": self.first_arrival_s,
            "last_active_s": self.last_active_s,
            "num_turns_arrived": self.num_turns_arrived,
            "num_turns_finished": self.num_turns_finished,
            "num_pins_created": self.num_pins_created,
            "pins_released": dict(self.pins_released),
            "last_ttl_s": self.last_ttl_s,
            "last_tool_name": self.last_tool_name,
        }


class JobTable:
    """Jobs by id, least recently active first.

    A job leaves the table when it ends (`remove`) or when `pop_idle` finds it idle for longer
    than the timeout with no unfinished turn and no pin, so the table stays bounded by the
    jobs active within one timeout.
    """

    def __init__(self, idle_timeout_s: float) -> None:
        if not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be positive, got {idle_timeout_s!r}")
        self.idle_timeout_s = idle_timeout_s
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self.num_created = 0  # jobs added since the table was made

    def get(self, job_id: str | None) -> Job | None:
        return None if job_id is None else self._jobs.get(job_id)

    def get_or_add(self, job_id: str, *, arrival_order: int, now_s: float) -> Job:
        job = self._jobs.get(job_id)
        if job is None:
            job = Job(job_id, arrival_order, first_arrival_s=now_s, last_active_s=now_s)
            self._jobs[job_id] = job
            self.num_created += 1
        return job

    def touch(self, job: Job, now_s: float) -> None:
        """Marks activity: the job moves to the back of the idle order."""
        job.last_active_s = max(job.last_active_s, now_s)
        self._jobs.move_to_end(job.job_id)

    def remove(self, job_id: str) -> Job | None:
        return self._jobs.pop(job_id, None)

    def pop_idle(self, now_s: float, is_busy: Callable[[Job], bool]) -> list[Job]:
        """Removes and returns the jobs idle for over the timeout, except those with an
        unfinished turn or that `is_busy` reports busy (holding a pin, say)."""
        cutoff_s = now_s - self.idle_timeout_s
        stale = list(itertools.takewhile(
            lambda job: job.last_active_s < cutoff_s, self._jobs.values()
        ))
        return [
            self._jobs.pop(job.job_id) for job in stale
            if job.num_unfinished_turns == 0 and not is_busy(job)
        ]

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[Job]:
        return iter(list(self._jobs.values()))
