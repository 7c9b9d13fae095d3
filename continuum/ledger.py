"""The job books every agent policy keeps: jobs, arrival order, and what the event stream
says happened to them.

A `JobLedger` is owned by one `AgentPolicy`, which feeds it the scheduler's events and lends
it (read-only) to its strategies, which rank requests and pins by it.
"""

from __future__ import annotations

from dataclasses import dataclass

from continuum.jobs import Job, JobTable
from engine.kv_cache.pins import Pin
from engine.request import Request, RequestStatus
from engine.scheduler import events
from engine.scheduler.policy import SchedulerView
from engine.scheduler.request_queue import QueueKey
from estimator.cost_model import H100_LLAMA_8B_PREFILL, PrefillCostModel


@dataclass(frozen=True, slots=True)
class ServiceCost:
    """Prices the engine time a finished turn took: the prefill seconds of the tokens it
    computed beyond its cached prefix, by `prefill` (the fit of the prefills the engine
    timed at start-up), or, where the engine could not time them (None), by the nominal
    H100 Llama-3.1-8B roofline, so that service still orders jobs by tokens computed."""

    prefill: PrefillCostModel | None = None

    def turn_s(self, request: Request) -> float:
        model = H100_LLAMA_8B_PREFILL if self.prefill is None else self.prefill
        num_cached_tokens = request.num_cached_tokens or 0
        return max(0.0, model.cost_s(request.num_tokens) - model.cost_s(num_cached_tokens))


@dataclass(frozen=True, slots=True)
class _Arrival:
    """An unfinished request as the ledger saw it arrive: its rank in arrival order, the time,
    and the job it was counted in (a job that ends and starts again under the same id is a
    new `Job`; turns of the old one never touch it)."""

    order: int
    time_s: float
    job: Job | None


class JobLedger:
    """Jobs by id (forgotten after `job_idle_timeout_s` idle) and each unfinished request's
    arrival. Arrival order, not arrival time, ranks requests and jobs, so that requests
    without a job are ordered exactly as by FCFS whatever timestamps clients send.
    `scheduler` is set when the policy is bound, and `service_cost` (which prices each
    finished turn's engine time) with it."""

    def __init__(self, job_idle_timeout_s: float) -> None:
        self.jobs = JobTable(job_idle_timeout_s)
        self.scheduler: SchedulerView
        self.service_cost = ServiceCost()
        self._num_arrivals = 0
        self._arrivals: dict[str, _Arrival] = {}  # by request id, until it finishes

    # What the event stream tells.
    def record(self, event: events.SchedulerEvent) -> Job | None:
        """Updates the books from one scheduler event; returns the job it ended (a
        `JobEnded` of a job the books held), else None."""
        match event:
            case events.RequestArrived(request=request, now_s=now_s):
                self._arrived(request, now_s)
            case events.Admitted(request=request, now_s=now_s):
                job = self.job_of(request)
                if job is not None:
                    self.jobs.touch(job, now_s)
            case events.RequestFinished(request=request, now_s=now_s):
                self._finished(request, now_s)
            case events.RetentionDecided(request=request, pin=pin, inputs=inputs):
                job = self.jobs.get(request.job_id)
                if job is not None:
                    job.last_tool_name = inputs.tool
                    if pin is not None:
                        job.num_pins_created += 1
                        job.last_ttl_s = pin.ttl_s
            case events.PinReleased(pin=pin):
                job = self.jobs.get(pin.job_id)
                if job is not None and pin.release_reason is not None:
                    job.pins_released[pin.release_reason.value] += 1
            case events.JobEnded(job_id=job_id):
                return self.jobs.remove(job_id)
        return None

    def _arrived(self, request: Request, now_s: float) -> None:
        order = self._num_arrivals
        self._num_arrivals += 1
        job = None if request.job_id is None else self.jobs.get_or_add(
            request.job_id, arrival_order=order, now_s=now_s)
        self._arrivals[request.request_id] = _Arrival(order, now_s, job)
        if job is not None:
            job.num_turns_arrived += 1
            job.num_unfinished_turns += 1
            self.jobs.touch(job, now_s)

    def _finished(self, request: Request, now_s: float) -> None:
        job = self.job_of(request)
        self._arrivals.pop(request.request_id, None)
        if job is None:
            return
        job.num_unfinished_turns -= 1
        self.jobs.touch(job, now_s)
        if request.status is not RequestStatus.FINISHED_ABORTED:
            job.num_turns_finished += 1
            job.attained_service_tokens += request.num_tokens - (request.num_cached_tokens or 0)
            job.attained_service_s += self.service_cost.turn_s(request)

    # Time-driven upkeep.
    def pop_idle_jobs(self, now_s: float) -> list[Job]:
        """Removes the jobs idle past the timeout with no unfinished turn and no pin."""
        return self.jobs.pop_idle(now_s, is_busy=lambda job: job.job_id in self.scheduler.pins)

    # Reading the books.
    def arrival(self, request: Request) -> tuple[float, int]:
        """(arrival time on the scheduler's clock, rank in arrival order)."""
        arrival = self._arrivals[request.request_id]
        return (arrival.time_s, arrival.order)

    def arrival_order(self, request: Request) -> int:
        """The request's rank in arrival order (0 for the first request ever seen)."""
        return self._arrivals[request.request_id].order

    def job_rank(self, request: Request) -> int:
        """The arrival rank of the request's job's first turn; a request without a job is
        its own one-turn job."""
        arrival = self._arrivals[request.request_id]
        return arrival.order if arrival.job is None else arrival.job.first_arrival_order

    def job_order(self, request: Request) -> QueueKey:
        """Program-level order: (the first arrival of the request's job, then its rank, then
        the request's rank); a request without a job is its own one-turn job."""
        return self.service_aged_order(request, 0.0)

    def service_aged_order(self, request: Request, service_weight: float) -> QueueKey:
        """Program-level order aged by service: as `job_order`, but the job's first arrival
        is moved later by `service_weight` times the engine seconds its finished turns took
        (`Job.attained_service_s`), so that a job yields to younger ones at a rate set by
        the service it consumes, whatever the load."""
        arrival = self._arrivals[request.request_id]
        job = arrival.job
        if job is None:
            return (arrival.time_s, arrival.order, arrival.order)
        aged_s = job.first_arrival_s + service_weight * job.attained_service_s
        return (aged_s, job.first_arrival_order, arrival.order)

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

    def num_waiting(self, job_id: str) -> int:
        """Waiting turns of the job."""
        return self.scheduler.waiting.num_waiting(job_id)

    def job_arrival_rank(self, job_id: str) -> float:
        """The arrival rank of the job's first turn (inf for a job the books do not hold)."""
        job = self.jobs.get(job_id)
        return float("inf") if job is None else job.first_arrival_order

    def policy_pins(self) -> list[Pin]:
        """The live pins the policy made (the scheduler gives clients' pins up itself)."""
        return [pin for pin in self.scheduler.pins if pin.source == "policy"]

    def latest_job_pin(self, exclude_job_id: str | None = None) -> Pin | None:
        """The policy's pin of the job that arrived last, the job `exclude_job_id`'s last of
        all."""
        return max(
            self.policy_pins(),
            key=lambda pin: (pin.job_id != exclude_job_id, self.job_arrival_rank(pin.job_id)),
            default=None,
        )
