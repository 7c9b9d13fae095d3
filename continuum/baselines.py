"""Agent-serving baselines run as policies of the same engine, for comparison with Continuum.

- `InferCeptPolicy` (InferCept, ICML 2024): keep the KV of a turn that called a tool until
  the job's next turn or memory pressure; under pressure the preserved context that is
  cheapest to recompute goes first. With `swap`, each such turn is preserved, discarded or
  swapped to the host tier by InferCept's waste model.
- `AutellixPolicy` (Autellix, 2025): program-level least attained service (PLAS): waiting
  turns ordered by their job's attained service, the most-served job preempted first.

InferCept and Autellix are simplified to what the scheduler decides; see each class.
"""

from __future__ import annotations

import dataclasses

from continuum.estimation import measured_prefill_cost, measured_reload_cost
from continuum.interception import InterceptionModel
from continuum.job_aware import JobAwarePolicy
from continuum.jobs import Job
from continuum.options import InferCeptOptions, JobOptions
from continuum.queues import KeyedRequestQueue, QueueKey
from engine.kv_cache.pins import Pin
from engine.request import Request, RequestStatus
from engine.scheduler.policy import Retention, RetentionInputs, SchedulerView, Victim


class InferCeptPolicy(JobAwarePolicy):
    """Preserve every tool-calling turn's KV, give it up first under memory pressure; with
    `swap`, choose for each such turn by InferCept's waste model.

    A non-final turn of a job that called a tool is pinned until its next turn is admitted,
    for at most the job idle timeout. Whenever blocks are short (a running request growing,
    or the waiting head being admitted, even while others run) pins are released before any
    request is preempted, the least wasteful first: the fewest pinned blocks (least
    recompute), then the oldest. The head's own job's pin goes last. Waiting order and
    victims are otherwise FCFS.

    With `swap` (`InferCeptOptions`), each such turn is instead preserved (pinned as above),
    discarded (freed without a store to the host tier) or swapped (freed with a store; the
    next turn loads it back), whichever wastes the least memory-time
    (`continuum.interception`): recompute is priced by the prefills and reload by the
    host-tier loads the engine times at start-up. Its `RetentionInputs` (in the trace) name
    the choice (`source`), the samples behind the tool's expected duration and the context's
    rebuild time by the alternative (`rebuild_s`).
    """

    options_type = InferCeptOptions
    options: InferCeptOptions

    def __init__(self, options: JobOptions | None = None) -> None:
        if options is not None and not isinstance(options, InferCeptOptions):
            options = InferCeptOptions(**dataclasses.asdict(options))  # swap off
        super().__init__(options)
        self.interception: InterceptionModel | None = None  # set by `bind` with swap on

    def bind(self, scheduler: SchedulerView) -> None:
        super().bind(scheduler)
        if self.options.swap:
            self.interception = InterceptionModel(
                recompute_cost=measured_prefill_cost(scheduler.environment),
                reload_cost=measured_reload_cost(scheduler),
                default_tool_duration_s=self.options.default_tool_duration_s,
            )

    def new_waiting_queue(self) -> KeyedRequestQueue:
        return KeyedRequestQueue(self._fcfs_key)

    def _fcfs_key(self, request: Request) -> QueueKey:
        return (request.status is not RequestStatus.PREEMPTED, self.arrival_order(request))

    def on_request_arrived(self, request: Request, now_s: float) -> None:
        super().on_request_arrived(request, now_s)
        job = self.job_of(request)
        if self.interception is not None and job is not None and job.num_turns_finished > 0:
            self.interception.observe_next_turn(job.job_id, now_s)

    def forget_job(self, job: Job) -> None:
        if self.interception is not None:
            self.interception.forget_job(job.job_id)

    def retention(self, request: Request, job: Job, now_s: float) -> Retention:
        call = self.tool_call(request, job, now_s)
        if call is None:
            return self.no_tool_call()
        ttl_s = self.jobs.idle_timeout_s
        if self.interception is None:
            return Retention(ttl_s, RetentionInputs(ttl_s=ttl_s, source="until-next-turn",
                                              tool=call.tool_name))
        self.interception.observe_tool_call(call)
        decision = self.interception.decide(call, block_size=self.scheduler.block_size,
                                            num_running_blocks=self._running_blocks(request))
        if decision.choice != "preserve":
            ttl_s = 0.0
        inputs = RetentionInputs(ttl_s=ttl_s, source=decision.choice, tool=call.tool_name,
                           num_samples=decision.num_samples, rebuild_s=decision.rebuild_s)
        return Retention(ttl_s, inputs, offload=decision.choice != "discard")

    def _running_blocks(self, finished: Request) -> int:
        """Blocks holding the KV of the requests running beside `finished`."""
        block_size = self.scheduler.block_size
        return sum(-(-request.num_computed_tokens // block_size)
                   for request in self.scheduler.running if request is not finished)

    def select_victim(self, request: Request, now_s: float) -> Victim:
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

    def new_waiting_queue(self) -> KeyedRequestQueue:
        return KeyedRequestQueue(self._plas_key)

    def _plas_key(self, request: Request) -> QueueKey:
        return (self._job_service(request), *self.job_order(request))

    def _job_service(self, request: Request) -> int:
        job = self.jobs.get(request.job_id)
        return 0 if job is None else job.attained_service_tokens

    def select_victim(self, request: Request, now_s: float) -> Victim:
        running = self.scheduler.running
        index = max(
            range(len(running)),
            key=lambda i: (self._job_service(running[i]) + running[i].num_computed_tokens, i),
        )
        return running[index]
