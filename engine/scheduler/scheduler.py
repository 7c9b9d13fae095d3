"""The V1-style scheduler: a unified token budget over running and waiting requests.

Mechanism only. Order, retention, victims and what a waiting prompt must find free are
delegated to a `SchedulingPolicy`; tenants' shares and reserved room to `Admission`; who
gives way under memory pressure, in which order, to `VictimChain`; pins and jobs are kept
by `PinKeeper`. This module never asks which policy it runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from engine.clock import Clock
from engine.config import CacheConfig, SchedulerConfig, check_pool_fits_one_sequence
from engine.kv_cache.block import KVCacheBlock
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.pins import Pin, PinReleaseReason, PinTable
from engine.outputs import EngineCoreOutput, ModelRunnerOutput
from engine.request import Request, RequestStatus
from engine.scheduler import events, invariants
from engine.scheduler.admission import Admission
from engine.scheduler.job_inference import JobInference
from engine.scheduler.output import SchedulerOutput
from engine.scheduler.pin_keeper import PinKeeper
from engine.scheduler.policy import PolicyEnvironment, SchedulingPolicy
from engine.scheduler.retention import POLICY_ERROR, Retention, RetentionInputs
from engine.scheduler.runner_output import apply_runner_output
from engine.scheduler.step_plan import AdmissionOutcome, StepPlan, emit
from engine.scheduler.sweep import Sweep
from engine.scheduler.tenant_queue import TenantFairQueue
from engine.scheduler.tracer import SchedulerTracer
from engine.scheduler.victim_chain import GiveWay, Preempt, ReleasePin, Shortage, VictimChain

logger = logging.getLogger(__name__)

class Scheduler:
    """Owns every unfinished request and the KV cache manager (with its pins, `PinKeeper`).

    Called by the engine core, once per step: `schedule()`, then (after the executor ran the
    step) `update_from_output()`. With async scheduling the engine core schedules step N+1
    before it updates from step N, so at most two steps are out at once: a request that
    samples in a step is given a placeholder for its token (`num_output_placeholders`) and
    may be scheduled again on it. `add_request` and `finish_requests` (abort) may be called
    between steps, and `sweep` (time-driven upkeep) while no request is unfinished. Times
    come from the injected `clock` (seconds). Everything that happens is emitted to one
    event stream (`events`, see `engine.scheduler.events`): the policy's subscriber (from
    `bind`) first, then a `tracer` given here (`close_subscribers` at shutdown). With
    `num_host_kv_blocks` > 0, evictable KV is stored to a host tier of that many blocks and
    prefixes found there are loaded back; each step's output carries its copies
    (`SchedulerOutput.kv_transfers`).
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        policy: SchedulingPolicy,
        *,
        num_kv_blocks: int | None = None,
        num_host_kv_blocks: int = 0,
        clock: Clock = time.monotonic,
        environment: PolicyEnvironment | None = None,
        tracer: SchedulerTracer | None = None,
    ) -> None:
        num_blocks = cache_config.num_kv_blocks if num_kv_blocks is None else num_kv_blocks
        if num_blocks is None:
            raise ValueError("the KV pool size is unknown: pass num_kv_blocks")
        check_pool_fits_one_sequence(num_blocks, cache_config.block_size,
                                     scheduler_config.max_model_len)
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.clock = clock
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
            num_host_blocks=num_host_kv_blocks,
        )
        self.events = events.SchedulerEvents()
        self._environment = PolicyEnvironment() if environment is None else environment
        self._pin_keeper = PinKeeper(
            self.kv_cache_manager, self.events,
            None if not scheduler_config.job_inference else JobInference(
                cache_config.block_size, max_turns=scheduler_config.job_inference_max_turns,
                max_age_s=scheduler_config.job_inference_max_age_s,
                decode=self._environment.decode))
        self._requests: dict[str, Request] = {}
        self._running: list[Request] = []
        self.policy = policy
        self._waiting = TenantFairQueue(policy.new_waiting_queue)
        self._admission = Admission(self, self.kv_cache_manager, self._pin_keeper.pins, policy,
                                    max_num_seqs=scheduler_config.max_num_seqs)
        self._victim_chain = VictimChain(self._admission, policy)
        self._finished_req_ids: set[str] = set()
        # The requests each step scheduled, by step id, until it is updated from its output.
        self._unfinished_steps: dict[int, dict[str, Request]] = {}
        self.step_id = 0
        self.num_preemptions = 0
        # Tokens computed again after preemption, counted as `trace summarize` does:
        # what a preemption dropped minus what the readmission got back from the cache.
        self.recomputed_tokens = 0
        self._dropped_tokens: dict[str, int] = {}  # by preempted request, until readmitted
        self._tracer = tracer
        policy_subscriber = policy.bind(self)
        if policy_subscriber is not None:
            self.subscribe(policy_subscriber)
        if tracer is not None:
            self.subscribe(tracer)

    # SchedulerView: what policies may see.
    @property
    def running(self) -> list[Request]:
        return self._running

    @property
    def waiting(self) -> TenantFairQueue:
        return self._waiting

    @property
    def pins(self) -> PinTable:
        return self._pin_keeper.pins

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache_manager.block_pool.num_blocks

    @property
    def num_host_kv_blocks(self) -> int:
        host_tier = self.kv_cache_manager.host_tier
        return 0 if host_tier is None else host_tier.num_blocks

    @property
    def environment(self) -> PolicyEnvironment:
        return self._environment

    # Not part of the policy's view.
    @property
    def tracer(self) -> SchedulerTracer | None:
        """The tracer given at construction, while it is subscribed (None once tracing
        stopped)."""
        return self._tracer if self._tracer in self.events.subscribers else None

    def subscribe(self, subscriber: events.SchedulerSubscriber) -> None:
        """Subscribes to the event stream from now on (ValueError if the subscriber
        refuses, as a tracer whose file cannot be created does). Call between steps (or at
        construction): the state it is sent names the next step."""
        self.events.subscribe(subscriber, events.SchedulerStarted(
            policy_name=self.policy.name,
            clock_origin_s=self.clock(), num_kv_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_num_seqs=self.config.max_num_seqs, first_step=self.step_id,
        ))

    def close_subscribers(self) -> None:
        """Closes every subscriber of the event stream (a tracer flushes and closes its
        file, the policy saves what it learned); none receives anything more."""
        self.events.close()

    @property
    def requests(self) -> dict[str, Request]:
        return self._requests

    @property
    def num_jobs_inferred(self) -> int:
        """Jobs the scheduler inferred for requests that named none."""
        return self._pin_keeper.num_jobs_inferred

    @property
    def num_jobs_ended(self) -> dict[str, int]:
        """Jobs ended (their last turn, a client's release, an inferred job that can no
        longer go on), by reason."""
        return dict(self._pin_keeper.num_jobs_ended)

    @property
    def job_inference(self) -> JobInference | None:
        """The table of recently finished turns of inferred jobs (None: inference is off)."""
        return self._pin_keeper.job_inference

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def has_pending_kv_transfers(self) -> bool:
        """Whether host-tier copies wait for the next step (stores of blocks freed since)."""
        transfers = self.kv_cache_manager.transfers
        return transfers is not None and transfers.num_pending > 0

    def add_request(self, request: Request) -> None:
        """Queues a new request; ValueError (and no change) if it can never be served.

        A request without a job gets an inferred one first, when job inference is on. Its
        `RequestArrived` goes out before it joins the waiting queue, so that the policy
        knows it when its queue orders it."""
        self.check_new_request(request)
        now_s = self.clock()
        inferred = self._pin_keeper.infer_job(request, now_s)
        self.events.emit(events.RequestArrived(
            request, now_s,
            inferred_from=None if inferred is None else inferred.continues_request_id,
        ))
        self._admission.note_arrival(request, now_s)
        self._requests[request.request_id] = request
        self._waiting.add_request(request)

    def check_new_request(self, request: Request) -> None:
        """ValueError if `add_request` would refuse `request`. A caller that holds a request
        back before queueing it (the engine core, while the request's grammar compiles) checks
        first, so that the refusal comes at once."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.job is not None and request.job.inferred:
            raise ValueError(f"request {request.request_id!r} names an inferred job: only the "
                             "scheduler infers jobs")
        if request.status is not RequestStatus.WAITING or request.num_output_tokens:
            raise ValueError(f"request {request.request_id!r} is not a fresh request")
        if request.num_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt of {request.num_tokens} tokens exceeds max_model_len "
                f"({self.config.max_model_len})"
            )

    def schedule(self, held_back: frozenset[str] = frozenset()) -> SchedulerOutput:
        """Plans one step: running requests first, then waiting ones if no running request
        was preempted or left waiting for memory (with several tenants, then only those that
        take their tenant's share back, `tenant_shares`); then every pin past its deadline is
        released, whoever waits for it (its job's waiting turn had the step to reuse it).
        `held_back` names requests that must not sample this step (the engine core's
        constrained requests whose grammar mask is not ready): they compute at most the
        tokens before their last one, and keep their blocks and their place."""
        now_s = self.clock()
        if self.events:  # the snapshot is the one event worth not building
            self.events.emit(events.StepStarted.of(
                self.step_id, now_s, self._running, self._waiting,
                self.kv_cache_manager.block_pool, self.pins, self.config))
        self.sweep(now_s)
        self._waiting.advance_to(now_s)
        plan = StepPlan(self.config, held_back)
        self._schedule_running(plan, now_s)
        self._schedule_waiting(plan, now_s,
                               memory_short=bool(plan.preempted) or bool(plan.stalled))
        self._pin_keeper.release_expired(now_s)
        transfers = self.kv_cache_manager.take_transfers()
        self.events.emit(events.StepPlanned(plan.admitted, plan.num_scheduled_tokens,
                                            plan.total_num_scheduled_tokens, transfers, now_s))
        output = emit(plan, step_id=self.step_id, finished_req_ids=self._finished_req_ids,
                      block_ids_of=self.kv_cache_manager.get_block_ids, transfers=transfers)
        self._unfinished_steps[self.step_id] = {
            request.request_id: request for request in (*plan.continuing, *plan.admitted)}
        self._finished_req_ids = set()
        self.step_id += 1
        return output

    def sweep(self, now_s: float | None = None) -> Sweep:
        """Time-driven upkeep: releases the pins past their deadline (EXPIRED) but those whose
        job has a turn waiting to reuse them, records the jobs the policy forgot (idle past
        its timeout, `SweepDecision`), and ends the inferred jobs whose latest turn aged out
        of the job inference table (counted as forgotten); returns what it released and
        forgot. Called at every step start, and by the engine core
        while no request is unfinished, at most once per sweep interval (`now_s` None: the
        clock's now), so that pins and idle jobs expire when no request arrives.

        Between steps no step is emitted: the pins it releases are (`PinReleased`, then
        `Flushed`); a trace records them as events of the next step number, and a sweep
        that did nothing writes nothing.
        """
        between_steps = now_s is None
        now_s = self.clock() if now_s is None else now_s
        pins_before = list(self.pins)
        self._pin_keeper.release_expired(now_s, spare=self._waiting.num_waiting)
        decision = self.policy.sweep(now_s)
        forgotten_job_ids = (*decision.forgotten_job_ids,
                             *self._pin_keeper.sweep_inferred_jobs(now_s))
        if between_steps:
            self.events.emit(events.Flushed())
        released_pins = tuple(pin for pin in pins_before if self.pins.get(pin.job_id) is not pin)
        return Sweep(released_pins, forgotten_job_ids)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Completes the step's host-tier copies, appends sampled tokens, applies stop
        conditions and finishes stopped requests (a request preempted after its step
        launched leaves the waiting queue)."""
        now_s = self.clock()
        self.events.emit(events.ApplyingOutput(scheduler_output.step_id))
        self.kv_cache_manager.complete_transfers()
        outputs, stopped = apply_runner_output(
            scheduler_output, runner_output,
            self._unfinished_steps.pop(scheduler_output.step_id, {}), self._requests,
            self.config.max_model_len, now_s,
        )
        stopped_ids = {request.request_id for request in stopped}
        running_ids = {request.request_id for request in self._running}
        self._running = [r for r in self._running if r.request_id not in stopped_ids]
        for request in stopped:
            if request.request_id not in running_ids:
                self._waiting.remove_request(request)
        for request in stopped:
            self._finish(request, request.status, now_s)
        self.events.emit(events.StepEnded(scheduler_output.step_id, self.step_id))
        return outputs

    def finish_requests(
        self,
        request_ids: Iterable[str],
        status: RequestStatus = RequestStatus.FINISHED_ABORTED,
    ) -> None:
        """Finishes requests from outside the step loop (abort). Unknown ids are ignored.

        An aborted turn of a job also releases that job's pin (reason ABORT).
        """
        if not status.is_finished:
            raise ValueError(f"{status.name} is not a finished status")
        now_s = self.clock()
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None:
                continue
            if request.status is RequestStatus.RUNNING:
                self._running.remove(request)
            else:
                self._waiting.remove_request(request)
            self._finish(request, status, now_s)
            if status is RequestStatus.FINISHED_ABORTED and request.job_id is not None:
                self._pin_keeper.release(request.job_id, PinReleaseReason.ABORT, now_s)

    def end_job(
        self, job_id: str, reason: PinReleaseReason = PinReleaseReason.RELEASE, *,
        now_s: float | None = None,
    ) -> Pin | None:
        """Ends a job at `now_s` (None: the clock's now): releases its pin (if any), forgets
        its turn in the job inference table (if it is an inferred job) and tells the policy
        (`JobEnded`); returns the pin."""
        return self._pin_keeper.end_job(job_id, reason,
                                        self.clock() if now_s is None else now_s)

    def reset_prefix_cache(self) -> bool:
        """Forgets all cached prefixes, the host tier's too; False (no change) while any
        block is held."""
        return self.kv_cache_manager.block_pool.reset_prefix_cache()

    # Scheduling.
    def _schedule_running(self, plan: StepPlan, now_s: float) -> None:
        index = 0
        while index < len(self._running) and plan.token_budget > 0:
            request = self._running[index]
            num_new_tokens = plan.num_new_tokens(request, request.num_computed_tokens)
            if num_new_tokens == 0:
                index += 1
                continue
            num_preempted = len(plan.preempted)
            new_blocks = self._allocate_or_preempt(request, num_new_tokens, plan, now_s)
            if request.status is not RequestStatus.RUNNING:
                break
            if new_blocks is None:
                plan.stalled.append(request)
            else:
                plan.add_continuing(request, num_new_tokens, new_blocks)
            if len(plan.preempted) != num_preempted:
                index = self._running.index(request)  # earlier victims shifted it
            index += 1

    def _allocate_or_preempt(
        self, request: Request, num_new_tokens: int, plan: StepPlan, now_s: float
    ) -> list[KVCacheBlock] | None:
        """Blocks for a running request, freeing victims until they fit; None if `request`
        itself was preempted, or waits this step (nothing gives way: it keeps its blocks and
        computes nothing)."""
        while (new_blocks := self.kv_cache_manager.allocate_slots(request, num_new_tokens)) is None:
            if (self._give_way(request, num_new_tokens, plan, now_s) is None
                    or request.status is not RequestStatus.RUNNING):
                return None
        return new_blocks

    def _give_way(self, request: Request, num_new_tokens: int, plan: StepPlan, now_s: float,
                  shortage: Shortage = "blocks") -> GiveWay | None:
        """Carries out the victim chain's next answer for `request` (`VictimChain.next`):
        releases the pin or preempts the request it names, for its reason; returns it (None:
        nothing gave way)."""
        give_way = self._victim_chain.next(request, num_new_tokens, plan, now_s, shortage)
        match give_way:
            case ReleasePin(pin=pin, reason=reason):
                self._pin_keeper.release_chosen((pin,), reason, now_s)
            case Preempt(request=victim, reason=reason):
                self._preempt(victim, plan, needed_by=request, reason=reason)
        return give_way

    def _preempt(self, request: Request, plan: StepPlan, *, needed_by: Request,
                 reason: events.PreemptionReason) -> None:
        self.events.emit(events.Preempted(request, needed_by, reason))
        self._running.remove(request)
        if request.request_id in plan.num_scheduled_tokens:
            plan.drop_continuing(request)
        self.kv_cache_manager.free(request)
        self._dropped_tokens[request.request_id] = request.num_computed_tokens
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting.prepend_request(request)
        plan.preempted.append(request)

    def _schedule_waiting(self, plan: StepPlan, now_s: float, *, memory_short: bool) -> None:
        """Admits waiting requests in policy order until one cannot get blocks. Without
        chunked prefill, a prompt that does not fit the remaining budget is passed over (it
        keeps its place) and the next one is tried, as in vLLM V1. When running requests
        were preempted or left waiting for memory this step (`memory_short`), only a request
        that takes its tenant's share from a tenant over its own is admitted. With several
        tenants, a tenant is passed over for the rest of the step when its next request was
        preempted this step, or cannot be admitted and would take its tenant past its share;
        the other tenants' requests are tried."""
        if memory_short and not self._admission.tenants_compete:
            return
        passed_over: list[Request] = []
        passed_over_tenants: set[str | None] = set()
        while plan.token_budget > 0:
            request = self._waiting.peek_request_excluding(passed_over_tenants)
            if request is None:
                break
            if request in plan.preempted:
                passed_over_tenants.add(request.tenant)
                continue
            outcome = self._try_admit(request, plan, now_s, memory_short=memory_short)
            if outcome is AdmissionOutcome.NO_MEMORY:
                if not self._admission.passes_share(request, plan):
                    break
                passed_over_tenants.add(request.tenant)
            elif outcome is AdmissionOutcome.OVER_BUDGET:
                self._waiting.remove_request(request)
                passed_over.append(request)
        for request in reversed(passed_over):
            self._waiting.prepend_request(request)

    def _try_admit(self, request: Request, plan: StepPlan, now_s: float, *,
                   memory_short: bool) -> AdmissionOutcome:
        """`_admit`, preempting for `request`'s tenant's share while its blocks are short
        (`Admission.share_victim`; a victim may free no block, its prefix cached for its
        tenant's other requests, so the loop ends once no tenant keeps its share without
        its latest request). NO_MEMORY at once if the step is short of memory, or the batch
        is full, and no share can be taken back."""
        full = len(self._running) >= self.config.max_num_seqs
        if memory_short or full:
            if not self._admission.takes_share_back(request, plan):
                return AdmissionOutcome.NO_MEMORY
            if full:
                self._give_way(request, 0, plan, now_s, "share")
        outcome = self._admit(request, plan, now_s)
        while (outcome is AdmissionOutcome.NO_MEMORY
               and self._give_way(request, 0, plan, now_s, "share") is not None):
            outcome = self._admit(request, plan, now_s)
        return outcome

    def _admit(self, request: Request, plan: StepPlan, now_s: float) -> AdmissionOutcome:
        """Moves a waiting request to running if its blocks fit (taking the victim chain's
        pins; while the room the policy reserves is short, the pins the policy gives up go
        at once, the request still waiting); its job's pin is released only after it took
        its own references."""
        kv_cache_manager = self.kv_cache_manager
        hit = kv_cache_manager.get_computed_blocks(request)
        num_new_tokens = plan.num_new_tokens(request, hit.num_tokens)
        if num_new_tokens == 0:
            return AdmissionOutcome.OVER_BUDGET
        if not self._admission.has_reserved_room(request, hit, num_new_tokens, now_s, plan):
            while self._give_way(request, num_new_tokens, plan, now_s, "reserved_room"):
                pass
            return AdmissionOutcome.NO_MEMORY
        while kv_cache_manager.allocate_slots(request, num_new_tokens, hit) is None:
            if self._give_way(request, num_new_tokens, plan, now_s) is None:
                return AdmissionOutcome.NO_MEMORY
            # Storing the released blocks may have evicted host blocks of the hit.
            hit = kv_cache_manager.get_computed_blocks(request)
            num_new_tokens = plan.num_new_tokens(request, hit.num_tokens)
            if num_new_tokens == 0:
                return AdmissionOutcome.OVER_BUDGET
        if request.status is RequestStatus.PREEMPTED:
            dropped = self._dropped_tokens.pop(request.request_id, 0)
            self.recomputed_tokens += max(0, dropped - hit.num_tokens)
        self._waiting.remove_admitted(request)
        self.events.emit(events.Admitted(
            request, hit, self.pins.get(request.job_id or ""),
            resumed=request.status is RequestStatus.PREEMPTED, now_s=now_s,
        ))
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = hit.num_tokens
        if request.num_cached_tokens is None:
            request.num_cached_tokens = hit.num_tokens
            request.first_scheduled_at_s = now_s
        self._running.append(request)
        plan.admitted.append(request)
        plan.add(request, num_new_tokens)
        if request.job_id is not None:
            self._pin_keeper.release(request.job_id, PinReleaseReason.REUSED, now_s)
        return AdmissionOutcome.ADMITTED

    # Finishing.
    def _finish(self, request: Request, status: RequestStatus, now_s: float) -> None:
        """Final bookkeeping of a request that left running/waiting: the policy's retention
        decision first, then `RequestFinished`, then its blocks pinned or freed."""
        request.status = status
        del self._requests[request.request_id]
        self._dropped_tokens.pop(request.request_id, None)
        self._finished_req_ids.add(request.request_id)
        retention = self._retention(request, now_s)
        self.events.emit(events.RequestFinished(request, now_s))
        cap = self._admission.pin_cap_blocks(request.tenant)
        if not self._pin_keeper.retain(request, retention, now_s, max_tenant_pinned_blocks=cap):
            self.kv_cache_manager.free(request,
                                       offload=retention is None or retention.offload)
        try:
            self._pin_keeper.turn_finished(request, now_s)
        except Exception:  # one turn's output must not end the engine: its job ends instead
            logger.exception("remembering the finished turn %s failed; its job ends",
                             request.request_id)
            if request.job is not None:
                self._pin_keeper.end_job(request.job.job_id, PinReleaseReason.JOB_END, now_s)

    def _retention(self, request: Request, now_s: float) -> Retention | None:
        """The policy's retention decision for finished `request`; where the policy fails on
        it (its output, say), the turn is not pinned, with the reason `policy-error` in the
        trace, and the engine goes on."""
        try:
            return self.policy.retention(request, now_s)
        except Exception:
            logger.exception("the policy's retention decision failed on %s; it is not pinned",
                             request.request_id)
            if request.status is RequestStatus.FINISHED_ABORTED:
                return None
            return Retention(0.0, RetentionInputs(ttl_s=0.0, source=POLICY_ERROR))

    def check_invariants(self) -> None:
        """Asserts the scheduler's and the KV cache's invariants (`invariants.check_invariants`);
        tests call it every step."""
        invariants.check_invariants(self)
