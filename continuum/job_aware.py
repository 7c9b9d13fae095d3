"""The shared base of the agent policies: per-job books, pin expiry and idle job timeout."""

from __future__ import annotations

from collections.abc import Callable

from continuum.jobs import Job, JobTable
from continuum.queues import QueueKey
from engine.kv_cache.pins import Pin, PinReleaseReason
from engine.request import Request
from engine.scheduler.policy import BasePolicy, PolicyJobState
from estimator.base import ToolCall, TTLEstimator

DEFAULT_JOB_IDLE_TIMEOUT_S = 600.0


class JobAwarePolicy(BasePolicy):
    """Keeps the books of every job it sees and feeds its estimator, if it has one.

    At each step start, pins past their deadline are released (EXPIRED) unless a turn of
    their job is waiting, and jobs idle for `job_idle_timeout_s` (no unfinished turn, no
    pin) are forgotten. Subclasses choose the waiting order (`new_waiting_queue`, using
    `arrival_order` and the job table), victims, and retention (`retention_ttl_s`; by default
    a non-final turn of a job is pinned for the estimator's TTL when it is positive).

    Arrival order, not arrival time, ranks requests and jobs, so that requests without a job
    are ordered exactly as by FCFS whatever timestamps clients send.
    """

    def __init__(
        self,
        *,
        estimator: TTLEstimator | None = None,
        job_idle_timeout_s: float = DEFAULT_JOB_IDLE_TIMEOUT_S,
    ) -> None:
        self.estimator = estimator
        self.jobs = JobTable(job_idle_timeout_s)
        self._num_arrivals = 0
        self._arrivals: dict[str, tuple[int, float]] = {}  # request id -> (order, time)

    # Ordering helpers for subclasses.
    def arrival_order(self, request: Request) -> int:
        """The request's rank in arrival order (0 for the first request ever seen)."""
        return self._arrivals[request.request_id][0]

    def job_order(self, request: Request) -> QueueKey:
        """(the first arrival of the request's job, the request's arrival); a request
        without a job is its own one-turn job."""
        order = self.arrival_order(request)
        job = self.jobs.get(request.job_id)
        return (order if job is None else job.first_arrival_order, order)

    def holds_pin(self, job_id: str | None) -> bool:
        return job_id is not None and job_id in self.scheduler.pins

    def num_waiting(self, job_id: str) -> int:
        """Waiting turns of the job (the queue must count them per job)."""
        return self.scheduler.waiting.num_waiting(job_id)  # type: ignore[attr-defined]

    # Lifecycle notifications.
    def on_step_start(self, now_s: float) -> None:
        for pin in self.scheduler.pins:
            if now_s > pin.deadline_s and self.num_waiting(pin.job_id) == 0:
                self.scheduler.release_pin(pin.job_id, PinReleaseReason.EXPIRED)
        for job in self.jobs.pop_idle(now_s, is_busy=lambda job: self.holds_pin(job.job_id)):
            self._forget(job)

    def on_request_arrived(self, request: Request, now_s: float) -> None:
        self._arrivals[request.request_id] = (self._num_arrivals, now_s)
        self._num_arrivals += 1
        if request.job_id is None:
            return
        job = self.jobs.get_or_add(
            request.job_id, arrival_order=self._num_arrivals - 1, now_s=now_s
        )
        job.num_turns_arrived += 1
        job.num_unfinished_turns += 1
        self.jobs.touch(job, now_s)
        if self.estimator is not None and job.num_turns_finished > 0:
            self.estimator.observe_next_turn(job.job_id, now_s)

    def on_request_admitted(self, request: Request, now_s: float) -> None:
        job = self.jobs.get(request.job_id)
        if job is None:
            return
        found_pin, job.pin_reused = job.pin_reused, False
        self.jobs.touch(job, now_s)
        returned_without_kv = (
            request.num_preemptions == 0 and not found_pin and job.num_turns_finished > 0
        )
        if self.estimator is not None and returned_without_kv:
            self.estimator.observe_queueing_delay(now_s - self._arrivals[request.request_id][1])

    def on_request_finished(self, request: Request, now_s: float) -> None:
        self._arrivals.pop(request.request_id, None)
        job = self.jobs.get(request.job_id)
        if job is None:
            return
        job.num_unfinished_turns -= 1
        job.num_turns_finished += 1
        job.attained_service_tokens += request.num_tokens - (request.num_cached_tokens or 0)
        self.jobs.touch(job, now_s)

    def on_job_ended(self, job_id: str, now_s: float) -> None:
        job = self.jobs.remove(job_id)
        if job is not None:
            self._forget(job)

    def _forget(self, job: Job) -> None:
        if self.estimator is not None:
            self.estimator.observe_job_end(job.job_id, job.num_turns_finished)

    def on_pin_added(self, pin: Pin) -> None:
        job = self.jobs.get(pin.job_id)
        if job is not None:
            job.num_pins_created += 1
            job.last_ttl_s = pin.ttl_s

    def on_pin_released(self, pin: Pin) -> None:
        job = self.jobs.get(pin.job_id)
        if job is None or pin.release_reason is None:
            return
        job.pins_released[pin.release_reason.value] += 1
        job.pin_reused = pin.release_reason is PinReleaseReason.REUSED

    # Retention.
    def retention_ttl_s(self, request: Request, now_s: float) -> float | None:
        call = self._tool_call(request, now_s)
        if call is None or self.estimator is None:
            return None
        self.estimator.observe_tool_call(call)
        ttl_s = self.estimator.ttl_s(call)
        return ttl_s if ttl_s > 0 else None

    def _tool_call(self, request: Request, now_s: float) -> ToolCall | None:
        """The tool call a finished turn made: every non-final turn of a known job is
        followed by its client's tool (the client said the job goes on)."""
        job = self.jobs.get(request.job_id)
        if job is None or request.job is None or request.job.is_last_step:
            return None
        return ToolCall(
            job_id=job.job_id,
            tool_name=request.job.tool_name,
            finished_at_s=now_s,
            num_context_tokens=request.num_tokens,
            turn_index=job.num_turns_finished - 1,
        )

    # Pins to give up.
    def latest_job_pin(self, exclude_job_id: str | None = None) -> Pin | None:
        """The pin of the job that arrived last, the job `exclude_job_id` last of all."""
        return max(
            self.scheduler.pins,
            key=lambda pin: (pin.job_id != exclude_job_id, self._first_arrival(pin.job_id)),
            default=None,
        )

    def _first_arrival(self, job_id: str) -> float:
        job = self.jobs.get(job_id)
        return float("inf") if job is None else job.first_arrival_order

    # Exposure.
    def job_state(self, job_id: str) -> PolicyJobState | None:
        job = self.jobs.get(job_id)
        return None if job is None else job.to_state()

    @property
    def num_jobs(self) -> int:
        return len(self.jobs)


def youngest(requests: list[Request], accept: Callable[[Request], bool]) -> Request | None:
    """The last request of `requests` (admission order) that `accept`s, or None."""
    return next((request for request in reversed(requests) if accept(request)), None)
