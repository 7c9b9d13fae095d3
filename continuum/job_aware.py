"""The shared base of the agent policies: per-job books, pin expiry and idle job timeout."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from continuum.estimation import save_estimator, tool_name_of, ttl_inputs
from continuum.jobs import Job, JobTable
from continuum.queues import JobCountingQueue, QueueKey
from engine.kv_cache.pins import Pin, PinReleaseReason
from engine.request import Request, RequestStatus
from engine.scheduler.policy import BasePolicy, PolicyJobState
from estimator.base import ToolCall, TTLEstimator

DEFAULT_JOB_IDLE_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class _Arrival:
    """An unfinished request as the policy saw it arrive: its rank in arrival order, the time,
    and the job it was counted in (a job that ends and starts again under the same id is a
    new `Job`; turns of the old one never touch it)."""

    order: int
    time_s: float
    job: Job | None


class JobAwarePolicy(BasePolicy):
    """Keeps the books of every job it sees and feeds its estimator, if it has one.

    At each step start, pins past their deadline are released (EXPIRED) unless a turn of
    their job is waiting, and jobs idle for `job_idle_timeout_s` (no unfinished turn, no
    pin) are forgotten. Subclasses choose the waiting order (`make_queue`, using
    `arrival_order` and the job table), victims, and retention (`retention_ttl_s`; by default
    a non-final turn of a job is pinned for the estimator's TTL when it is positive).

    Arrival order, not arrival time, ranks requests and jobs, so that requests without a job
    are ordered exactly as by FCFS whatever timestamps clients send.
    """

    _waiting: JobCountingQueue  # created by the scheduler through `new_waiting_queue`

    def __init__(
        self,
        *,
        estimator: TTLEstimator | None = None,
        job_idle_timeout_s: float = DEFAULT_JOB_IDLE_TIMEOUT_S,
    ) -> None:
        self.estimator = estimator
        self.jobs = JobTable(job_idle_timeout_s)
        self._num_arrivals = 0
        self._arrivals: dict[str, _Arrival] = {}  # by request id, until it finishes
        self._finishing: tuple[str, Job | None] | None = None  # for `retention_ttl_s`

    def new_waiting_queue(self) -> JobCountingQueue:
        self._waiting = self.make_queue()
        return self._waiting

    def make_queue(self) -> JobCountingQueue:
        """The scheduler's waiting queue, in this policy's order."""
        raise NotImplementedError

    # Ordering helpers for subclasses.
    def arrival_order(self, request: Request) -> int:
        """The request's rank in arrival order (0 for the first request ever seen)."""
        return self._arrivals[request.request_id].order

    def job_order(self, request: Request) -> QueueKey:
        """(the first arrival of the request's job, the request's arrival); a request
        without a job is its own one-turn job."""
        arrival = self._arrivals[request.request_id]
        job = arrival.job
        return (arrival.order if job is None else job.first_arrival_order, arrival.order)

    def job_of(self, request: Request) -> Job | None:
        """The live job an unfinished request belongs to; None without a job, or if its job
        ended since the request arrived."""
        arrival = self._arrivals.get(request.request_id)
        job = None if arrival is None else arrival.job
        return job if job is not None and self.jobs.get(job.job_id) is job else None

    def holds_pin(self, job_id: str | None) -> bool:
        return job_id is not None and job_id in self.scheduler.pins

    def num_waiting(self, job_id: str) -> int:
        """Waiting turns of the job."""
        return self._waiting.num_waiting(job_id)

    # Lifecycle notifications.
    def on_step_start(self, now_s: float) -> None:
        for pin in self.scheduler.pins:
            if now_s > pin.deadline_s and self.num_waiting(pin.job_id) == 0:
                self.scheduler.release_pin(pin.job_id, PinReleaseReason.EXPIRED)
        for job in self.jobs.pop_idle(now_s, is_busy=lambda job: self.holds_pin(job.job_id)):
            self._forget(job)

    def on_request_arrived(self, request: Request, now_s: float) -> None:
        order = self._num_arrivals
        self._num_arrivals += 1
        job = None if request.job_id is None else self.jobs.get_or_add(
            request.job_id, arrival_order=order, now_s=now_s
        )
        self._arrivals[request.request_id] = _Arrival(order, now_s, job)
        if job is None:
            return
        job.num_turns_arrived += 1
        job.num_unfinished_turns += 1
        self.jobs.touch(job, now_s)
        if self.estimator is not None and job.num_turns_finished > 0:
            self.estimator.observe_next_turn(job.job_id, now_s)

    def on_request_admitted(self, request: Request, now_s: float) -> None:
        job = self.job_of(request)
        if job is None:
            return
        found_pin, job.pin_reused = job.pin_reused, False
        self.jobs.touch(job, now_s)
        returned_without_kv = (
            request.num_preemptions == 0 and not found_pin and job.num_turns_finished > 0
        )
        if self.estimator is not None and returned_without_kv:
            self.estimator.observe_queueing_delay(now_s - self._arrivals[request.request_id].time_s)

    def on_request_finished(self, request: Request, now_s: float) -> None:
        job = self.job_of(request)
        self._arrivals.pop(request.request_id, None)
        self._finishing = (request.request_id, job)
        if job is None:
            return
        job.num_unfinished_turns -= 1
        self.jobs.touch(job, now_s)
        if request.status is RequestStatus.FINISHED_ABORTED:
            return  # not a turn of the job: its client gave up on it
        job.num_turns_finished += 1
        job.attained_service_tokens += request.num_tokens - (request.num_cached_tokens or 0)

    def on_job_ended(self, job_id: str, now_s: float) -> None:
        job = self.jobs.remove(job_id)
        if job is not None:
            self._forget(job)

    def on_shutdown(self) -> None:
        save_estimator(self.estimator, self.scheduler.environment)

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
        tracer = self.scheduler.tracer
        if tracer is not None:
            tracer.note_ttl_decision(request.request_id, ttl_inputs(call, self.estimator, ttl_s))
        return ttl_s if ttl_s > 0 else None

    def _tool_call(self, request: Request, now_s: float) -> ToolCall | None:
        """The tool call a turn that just finished made: every non-final turn of a live job
        is followed by its client's tool (the client said the job goes on), named by the
        client or, for an estimator, parsed from the output (None if neither says)."""
        finishing, self._finishing = self._finishing, None
        job = finishing[1] if finishing and finishing[0] == request.request_id else None
        if job is None or request.job is None or request.job.is_last_step:
            return None
        tool_name = (request.job.tool_name if self.estimator is None
                     else tool_name_of(request, self.scheduler.environment))
        job.last_tool_name = tool_name
        return ToolCall(
            job_id=job.job_id,
            tool_name=tool_name,
            finished_at_s=now_s,
            num_context_tokens=request.num_tokens,
            turn_index=job.num_turns_finished - 1,
            num_running_requests=sum(1 for other in self.scheduler.running
                                     if other is not request),
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
