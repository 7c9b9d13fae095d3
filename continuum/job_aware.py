"""The shared base of the agent policies: per-job books, arrival order, pin expiry, the idle
job timeout, and reading which tool a finished turn called."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from continuum.jobs import Job, JobTable
from continuum.options import JobOptions
from continuum.queues import QueueKey
from engine.kv_cache.pins import Pin
from engine.request import Request, RequestStatus
from engine.scheduler.policy import (
    BasePolicy,
    JobBooks,
    Retention,
    RetentionInputs,
    SweepDecision,
)
from engine.scheduler.request_queue import RequestQueue
from engine.tool_calls import ToolCallFormat
from estimator.base import ToolCall
from estimator.parsing import ParsedToolCalls, tool_key, without_control_tokens

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Arrival:
    """An unfinished request as the policy saw it arrive: its rank in arrival order, the time,
    and the job it was counted in (a job that ends and starts again under the same id is a
    new `Job`; turns of the old one never touch it)."""

    order: int
    time_s: float
    job: Job | None


class JobAwarePolicy(BasePolicy):
    """Keeps the books of every job it sees.

    At each sweep (every step start, and on a timer while the engine is idle), pins past
    their deadline are to be released (EXPIRED) unless a turn of their job is waiting, and jobs
    idle for `job_idle_timeout_s` (no unfinished turn, no pin) are forgotten. A pin past its
    deadline whose job's turn was waiting is released at the end of that step's planning if
    the turn was not admitted in it: a pin's deadline is a hard end. Subclasses
    choose the waiting order (`new_waiting_queue`, using the arrival and job-order helpers),
    victims, and retention (`retention`: by default nothing is pinned).

    Arrival order, not arrival time, ranks requests and jobs, so that requests without a job
    are ordered exactly as by FCFS whatever timestamps clients send.
    """

    options_type = JobOptions

    def __init__(self, options: JobOptions | None = None) -> None:
        self.options = self.options_type() if options is None else options
        self.jobs = JobTable(self.options.job_idle_timeout_s)
        self._num_arrivals = 0
        self._arrivals: dict[str, _Arrival] = {}  # by request id, until it finishes

    def new_waiting_queue(self) -> RequestQueue:
        """The scheduler's waiting queue, in this policy's order."""
        raise NotImplementedError

    # Ordering helpers for subclasses.
    def arrival_order(self, request: Request) -> int:
        """The request's rank in arrival order (0 for the first request ever seen)."""
        return self._arrivals[request.request_id].order

    def arrival(self, request: Request) -> tuple[float, int]:
        """(arrival time on the scheduler's clock, rank in arrival order)."""
        arrival = self._arrivals[request.request_id]
        return (arrival.time_s, arrival.order)

    def job_rank(self, request: Request) -> int:
        """The arrival rank of the request's job's first turn; a request without a job is
        its own one-turn job."""
        arrival = self._arrivals[request.request_id]
        return arrival.order if arrival.job is None else arrival.job.first_arrival_order

    def job_order(self, request: Request, max_job_age_s: float = float("inf")) -> QueueKey:
        """Program-level order: (the first arrival of the request's job, then its rank, then
        the request's rank), except that no turn sorts by a time more than `max_job_age_s`
        before its own arrival (then it sorts by that time and its own rank)."""
        arrival = self._arrivals[request.request_id]
        job = arrival.job
        if job is None:
            return (arrival.time_s, arrival.order, arrival.order)
        floor_s = arrival.time_s - max_job_age_s
        if job.first_arrival_s >= floor_s:
            return (job.first_arrival_s, job.first_arrival_order, arrival.order)
        return (floor_s, arrival.order, arrival.order)

    def job_of(self, request: Request) -> Job | None:
        """The live job an unfinished request belongs to; None without a job, or if its job
        ended since the request arrived."""
        arrival = self._arrivals.get(request.request_id)
        job = None if arrival is None else arrival.job
        return job if job is not None and self.jobs.get(job.job_id) is job else None

    def is_plain(self, request: Request) -> bool:
        """Whether an unfinished request is ordered as one without a job: it named no job
        and continues no earlier turn (none, or the first turn of an inferred job)."""
        if request.job is None:
            return True
        if not request.job.inferred:
            return False
        job = self.job_of(request)
        return job is None or job.num_turns_finished == 0

    def holds_pin(self, job_id: str | None) -> bool:
        return job_id is not None and job_id in self.scheduler.pins

    def num_waiting(self, job_id: str) -> int:
        """Waiting turns of the job."""
        return self.scheduler.waiting.num_waiting(job_id)

    # Time-driven upkeep.
    def sweep(self, now_s: float) -> SweepDecision:
        # A pin past its deadline stays while a turn of its job waits to reuse it.
        expired = tuple(pin for pin in self.scheduler.pins
                        if now_s > pin.deadline_s and self.num_waiting(pin.job_id) == 0)
        expired_job_ids = {pin.job_id for pin in expired}
        idle = self.jobs.pop_idle(now_s, is_busy=lambda job: (
            job.job_id not in expired_job_ids and self.holds_pin(job.job_id)))
        for job in idle:
            self.forget_job(job)
        return SweepDecision(expired, tuple(job.job_id for job in idle))

    def expired_pins(self, now_s: float) -> list[Pin]:
        return [pin for pin in self.scheduler.pins if now_s > pin.deadline_s]

    # Lifecycle notifications.
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

    def on_request_admitted(self, request: Request, reused_pin: Pin | None,
                            now_s: float) -> None:
        job = self.job_of(request)
        if job is not None:
            self.jobs.touch(job, now_s)

    def on_request_finished(self, request: Request, now_s: float) -> Retention | None:
        job = self.job_of(request)
        self._arrivals.pop(request.request_id, None)
        if job is None:
            return None
        job.num_unfinished_turns -= 1
        self.jobs.touch(job, now_s)
        if request.status is RequestStatus.FINISHED_ABORTED:
            return None  # not a turn of the job: its client gave up on it
        job.num_turns_finished += 1
        job.attained_service_tokens += request.num_tokens - (request.num_cached_tokens or 0)
        if request.job is None or request.job.is_last_step:
            return None
        return self.retention(request, job, now_s)

    def retention(self, request: Request, job: Job, now_s: float) -> Retention | None:
        """Whether to pin a finished, non-final turn of a live job (None: the policy never
        pins, nothing to explain)."""
        return None

    def on_job_ended(self, job_id: str, now_s: float) -> None:
        job = self.jobs.remove(job_id)
        if job is not None:
            self.forget_job(job)

    def forget_job(self, job: Job) -> None:
        """`job` left the books (it ended, or idled out)."""

    def on_pin_added(self, pin: Pin) -> None:
        job = self.jobs.get(pin.job_id)
        if job is not None and not pin.holds_waiting_turn:
            job.num_pins_created += 1
            job.last_ttl_s = pin.ttl_s

    def on_pin_released(self, pin: Pin) -> None:
        job = self.jobs.get(pin.job_id)
        if job is not None and pin.release_reason is not None and not pin.holds_waiting_turn:
            job.pins_released[pin.release_reason.value] += 1

    # Tool calls.
    def tool_call(self, request: Request, job: Job, now_s: float) -> ToolCall | None:
        """The tool call a finished, non-final turn of `job` made, or None if it called no
        tool: the tool is the client's `tool_name`, else parsed from the turn's output."""
        tool_name = self._tool_name(request)
        job.last_tool_name = tool_name
        if tool_name is None:
            return None
        others = [other for other in self.scheduler.running if other is not request]
        pool_tokens = self.scheduler.block_size * self.scheduler.num_kv_blocks
        return ToolCall(
            job_id=job.job_id,
            tool_name=tool_name,
            finished_at_s=now_s,
            num_context_tokens=request.num_tokens,
            turn_index=job.num_turns_finished - 1,
            num_running_requests=len(others),
            request_id=request.request_id,
            num_waiting_requests=len(self.scheduler.waiting),
            pool_share=request.num_computed_tokens / pool_tokens,
            running_pool_share=sum(other.num_computed_tokens for other in others) / pool_tokens,
        )

    def _tool_name(self, request: Request) -> str | None:
        client_name = None if request.job is None else request.job.tool_name
        named = tool_key(None, client_tool_name=client_name)
        decode = self.scheduler.environment.decode
        if named is not None or decode is None:
            return named
        try:
            text = decode(request.output_token_ids)
        except Exception as error:  # a step must not fail over one undecodable output
            logger.warning("cannot decode the output of %s to read its tool: %s",
                           request.request_id, error)
            return None
        if request.tool_call_format is None:
            return tool_key(text)
        return _returned_tool_key(request.tool_call_format, text)

    @staticmethod
    def no_tool_call() -> Retention:
        """The decision for a turn that called no tool: not pinned."""
        return Retention(0.0, RetentionInputs(ttl_s=0.0, source="no-tool-call"))

    # Pins to give up.
    def latest_job_pin(self, exclude_job_id: str | None = None) -> Pin | None:
        """The pin of the job that arrived last, the job `exclude_job_id` last of all."""
        return max(
            self.scheduler.pins,
            key=lambda pin: (pin.job_id != exclude_job_id, self.job_arrival_rank(pin.job_id)),
            default=None,
        )

    def job_arrival_rank(self, job_id: str) -> float:
        """The arrival rank of the job's first turn (inf for a job the books do not hold)."""
        job = self.jobs.get(job_id)
        return float("inf") if job is None else job.first_arrival_order

    # Exposure.
    def job_state(self, job_id: str) -> JobBooks | None:
        job = self.jobs.get(job_id)
        return None if job is None else job.books()

    @property
    def num_jobs(self) -> int:
        return len(self.jobs)


def _returned_tool_key(tool_call_format: ToolCallFormat, text: str) -> str | None:
    """The statistics key of the calls the server returned to the client for `text` (read
    by the request's own parser), or None when it returned none."""
    calls = tool_call_format.make_parser().parse(without_control_tokens(text)).tool_calls
    return ParsedToolCalls(tuple(call.name for call in calls), "server").key if calls else None
