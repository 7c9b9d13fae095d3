"""Agent-serving baselines run as policies of the same engine, for comparison with Continuum.

- `InferCeptPolicy` (InferCept, ICML 2024): keep the KV of a turn that called a tool until
  the job's next turn or memory pressure; under pressure the preserved context that is
  cheapest to recompute goes first.
- `AutellixPolicy` (Autellix, 2025): program-level least attained service (PLAS): waiting
  turns ordered by their job's attained service, the most-served job preempted first.

InferCept and Autellix are simplified to what the scheduler decides; see each class.
"""

from __future__ import annotations

from continuum.job_aware import JobAwarePolicy
from continuum.jobs import Job
from continuum.queues import KeyedRequestQueue, QueueKey
from engine.kv_cache.pins import Pin
from engine.request import Request, RequestStatus
from engine.scheduler.policy import Retention, Victim
from tracing.records import TTLInputs


class InferCeptPolicy(JobAwarePolicy):
    """Preserve every tool-calling turn's KV, give it up first under memory pressure.

    A non-final turn of a job that called a tool is pinned until its next turn is admitted,
    for at most the job idle timeout. Whenever blocks are short (a running request growing,
    or the waiting head being admitted, even while others run) pins are released before any
    request is preempted, the least wasteful first: the fewest pinned blocks (least
    recompute), then the oldest. The head's own job's pin goes last. Waiting order and
    victims are otherwise FCFS.
    """

    def make_queue(self) -> KeyedRequestQueue:
        return KeyedRequestQueue(self._fcfs_key)

    def _fcfs_key(self, request: Request) -> QueueKey:
        return (request.status is not RequestStatus.PREEMPTED, self.arrival_order(request))

    def retention(self, request: Request, job: Job, now_s: float) -> Retention:
        call = self.tool_call(request, job, now_s)
        if call is None:
            return self.no_tool_call()
        ttl_s = self.jobs.idle_timeout_s
        return Retention(ttl_s, TTLInputs(ttl_s=ttl_s, source="until-next-turn",
                                          tool=call.tool_name))

    def select_victim(self, request: Request) -> Victim:
        pin = self._least_waste_pin(exclude_job_id=None)
        return pin if pin is not None else self.scheduler.running[-1]

    def select_pin_to_release(self, request: Request, now_s: float) -> Pin | None:
        return self._least_waste_pin(exclude_job_id=request.job_id)

    def _least_waste_pin(self, exclude_job_id: str | None) -> Pin | None:
        return min(
            self.scheduler.pins,
            key=lambda pin: (pin.job_id == exclude_job_id, pin.num_blocks, pin.pinned_at_s),
            default=None,
        )


class AutellixPolicy(JobAwarePolicy):
    """Program-level least attained service, without pins.

    A job's attained service is the tokens its finished turns computed (prompt tokens that
    missed the prefix cache plus output tokens); a request without a job is a one-turn job.
    Waiting turns are keyed when they enter the queue by (their job's attained service, the
    job's first arrival, their own arrival). The victim is the running request whose job has
    the most service, counting the request's own progress; ties go to the youngest.
    Autellix's discretised queues and starvation guard are not modelled.
    """

    def make_queue(self) -> KeyedRequestQueue:
        return KeyedRequestQueue(self._plas_key)

    def _plas_key(self, request: Request) -> QueueKey:
        return (self._job_service(request), *self.job_order(request))

    def _job_service(self, request: Request) -> int:
        job = self.jobs.get(request.job_id)
        return 0 if job is None else job.attained_service_tokens

    def select_victim(self, request: Request) -> Victim:
        running = self.scheduler.running
        index = max(
            range(len(running)),
            key=lambda i: (self._job_service(running[i]) + running[i].num_computed_tokens, i),
        )
        return running[index]
