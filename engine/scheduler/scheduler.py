"""The V1-style scheduler: a unified token budget over running and waiting requests.

Mechanism only. Order, retention, victims and pin releases for admission are delegated to a
`SchedulingPolicy`; this module never asks which policy it runs.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from engine.clock import Clock
from engine.config import CacheConfig, SchedulerConfig, check_pool_fits_one_sequence
from engine.kv_cache.block import KVCacheBlock
from engine.kv_cache.manager import KVCacheManager, PrefixHit
from engine.kv_cache.pins import Pin, PinReleaseReason, PinTable
from engine.kv_cache.transfers import KVTransfers
from engine.outputs import EngineCoreOutput, ModelRunnerOutput
from engine.request import Request, RequestStatus
from engine.scheduler import events, invariants
from engine.scheduler.job_inference import InferredJob, JobInference
from engine.scheduler.output import SchedulerOutput
from engine.scheduler.policy import (
    PolicyEnvironment,
    Retention,
    RetentionInputs,
    SchedulingPolicy,
)
from engine.scheduler.runner_output import apply_runner_output
from engine.scheduler.step_plan import Admission, StepPlan, emit
from engine.scheduler.sweep import Sweep
from engine.scheduler.tenant_queue import TenantFairQueue
from engine.scheduler.tenant_shares import TenantShares
from engine.scheduler.tracer import SchedulerTracer


class Scheduler:
    """Owns every unfinished request, the KV cache manager and the pin table.

    Called by the engine core, once per step: `schedule()`, then (after the executor ran the
    step) `update_from_output()`. With async scheduling the engine core schedules step N+1
    before it updates from step N, so at most two steps are out at once: a request that
    samples in a step is given a placeholder for its token (`num_output_placeholders`) and
    may be scheduled again on it. `add_request` and `finish_requests` (abort) may be called
    between steps, and `sweep` (time-driven upkeep) while no request is unfinished. Times
    come from the injected `clock` (seconds). Everything that happens is emitted to one
    event stream (`events`, see `engine.scheduler.events`); a `tracer` given here is
    subscribed to it (`close_subscribers` at shutdown). With `num_host_kv_blocks` > 0,
    evictable KV is stored to a host tier of that many blocks and prefixes found there are
    loaded back; each step's output carries its copies (`SchedulerOutput.kv_transfers`).
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
        self._pins = PinTable(
            self.kv_cache_manager.block_pool,
            on_added=policy.on_pin_added, on_released=self._on_pin_released,
        )
        self._requests: dict[str, Request] = {}
        self._running: list[Request] = []
        # Up to two of the tenants seen (None among them): tenants' shares apply from two on.
        self._tenants_seen: set[str | None] = set()
        self.policy = policy
        self._waiting = TenantFairQueue(policy.new_waiting_queue)
        self._finished_req_ids: set[str] = set()
        # The requests each step scheduled, by step id, until it is updated from its output.
        self._unfinished_steps: dict[int, dict[str, Request]] = {}
        self.step_id = 0
        self.num_preemptions = 0
        # Tokens computed again after preemption, counted as `trace summarize` does:
        # what a preemption dropped minus what the readmission got back from the cache.
        self.recomputed_tokens = 0
        self._dropped_tokens: dict[str, int] = {}  # by preempted request, until readmitted
        self._environment = PolicyEnvironment() if environment is None else environment
        self._job_inference = None if not scheduler_config.job_inference else JobInference(
            cache_config.block_size, max_turns=scheduler_config.job_inference_max_turns,
            max_age_s=scheduler_config.job_inference_max_age_s,
        )
        self.events = events.SchedulerEvents()
        self._tracer = tracer
        if tracer is not None:
            self.subscribe(tracer)
        policy.bind(self)

    # SchedulerView: what policies may see.
    @property
    def running(self) -> list[Request]:
        return self._running

    @property
    def waiting(self) -> TenantFairQueue:
        return self._waiting

    @property
    def pins(self) -> PinTable:
        return self._pins

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
        policy = self.policy
        self.events.subscribe(subscriber, events.SchedulerStarted(
            policy_name=f"{type(policy).__module__}.{type(policy).__qualname__}",
            clock_origin_s=self.clock(), num_kv_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_num_seqs=self.config.max_num_seqs, first_step=self.step_id,
        ))

    @property
    def requests(self) -> dict[str, Request]:
        return self._requests

    @property
    def job_inference(self) -> JobInference | None:
        """The table of recently finished turns of inferred jobs (None: inference is off)."""
        return self._job_inference

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def has_pending_kv_transfers(self) -> bool:
        """Whether host-tier copies wait for the next step (stores of blocks freed since)."""
        transfers = self.kv_cache_manager.transfers
        return transfers is not None and transfers.num_pending > 0

    def add_request(self, request: Request) -> None:
        """Queues a new request; ValueError (and no change) if it can never be served.

        A request without a job gets an inferred one first, when job inference is on."""
        self.check_new_request(request)
        now_s = self.clock()
        inferred = self._infer_job(request, now_s)
        self.policy.on_request_arrived(request, now_s)
        if len(self._tenants_seen) < 2:
            self._tenants_seen.add(request.tenant)
        self._requests[request.request_id] = request
        self._waiting.add_request(request)
        self.events.emit(events.RequestArrived(
            request, now_s,
            inferred_from=None if inferred is None else inferred.continues_request_id,
        ))
        self._hold_on_arrival(request, now_s)

    def _hold_on_arrival(self, request: Request, now_s: float) -> None:
        """Holds the device-cached prefix of a job's turn that arrived while its job holds no
        pin, as its job's pin, for as long as the policy says (`arrival_hold_s`)."""
        job_id = request.job_id
        if job_id is None or self._pins.get(job_id) is not None:
            return
        hit = self.kv_cache_manager.get_computed_blocks(request)
        if not hit.blocks:
            return
        ttl_s = self.policy.arrival_hold_s(request, hit.num_device_tokens, now_s)
        if ttl_s is None or not ttl_s > 0:
            return
        self.kv_cache_manager.block_pool.touch(hit.blocks)
        pin = self._pins.add(job_id, request.request_id, list(hit.blocks), now_s=now_s,
                             ttl_s=ttl_s, holds_waiting_turn=True)
        self.events.emit(events.RetentionDecided(
            request, pin, RetentionInputs(ttl_s=ttl_s, source="arrival-hold"), now_s))

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
        take their tenant's share back, `tenant_shares`); then pins past their end are
        released.
        `held_back` names requests that must not sample this step (the engine core's
        constrained requests whose grammar mask is not ready): they compute at most the
        tokens before their last one, and keep their blocks and their place."""
        now_s = self.clock()
        if self.events:  # the snapshot is the one event worth not building
            self.events.emit(self._step_started(now_s))
        self._sweep_policy(now_s)
        self._sweep_inferred_jobs(now_s)
        self._waiting.advance_to(now_s)
        plan = StepPlan(self.config.max_num_batched_tokens, held_back)
        self._schedule_running(plan, now_s)
        self._schedule_waiting(plan, now_s,
                               memory_short=bool(plan.preempted) or bool(plan.stalled))
        self._expire_pins(now_s)
        transfers = self.kv_cache_manager.take_transfers()
        self.events.emit(events.StepPlanned(plan.admitted, plan.num_scheduled_tokens,
                                            plan.total_num_scheduled_tokens, transfers, now_s))
        return self._emit(plan, transfers)

    def _step_started(self, now_s: float) -> events.StepStarted:
        """The state entering the step: requests, the block pool and the pins."""
        pool = self.kv_cache_manager.block_pool
        return events.StepStarted(
            self.step_id, now_s, self._running, self._waiting,
            events.PoolState(
                num_total_blocks=pool.num_blocks, num_free_blocks=pool.num_free_blocks,
                num_cached_free_blocks=pool.num_cached_free_blocks,
                num_pinned_blocks=self._pins.num_pinned_blocks,
                pinned_job_ids=[pin.job_id for pin in self._pins],
            ),
            token_budget=self.config.max_num_batched_tokens,
            max_num_seqs=self.config.max_num_seqs,
        )

    def sweep(self) -> Sweep:
        """Time-driven upkeep between steps, without a step: the scheduler releases the pins
        the policy's `SweepDecision` says ran out, and the policy forgets jobs idle past its
        timeout (`SchedulingPolicy.sweep`, which `schedule()` also runs at every step
        start). Called by the engine core while no request is unfinished, at most once per
        sweep interval, so that pins and idle jobs expire when no request arrives; returns
        what it released and forgot. Inferred jobs
        whose latest turn aged out of the job inference table end here too (and count as
        forgotten).

        No step is emitted: the pins it releases are (`PinReleased`, then `Flushed`); a
        trace records them as events of the next step number, and a sweep that did nothing
        writes nothing.
        """
        pins_before = list(self._pins)
        now_s = self.clock()
        forgotten_job_ids = (*self._sweep_policy(now_s), *self._sweep_inferred_jobs(now_s))
        released_pins = tuple(pin for pin in pins_before if self._pins.get(pin.job_id) is not pin)
        self.events.emit(events.Flushed())
        return Sweep(released_pins, forgotten_job_ids)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Completes the step's host-tier copies, appends sampled tokens, applies stop
        conditions and finishes stopped requests."""
        now_s = self.clock()
        self.events.emit(events.ApplyingOutput(scheduler_output.step_id))
        self.kv_cache_manager.complete_transfers()
        outputs, stopped = apply_runner_output(
            scheduler_output, runner_output,
            self._unfinished_steps.pop(scheduler_output.step_id, {}), self._requests,
            self.config.max_model_len, now_s,
        )
        if stopped:
            self._retire(stopped, now_s)
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
                self.release_pin(request.job_id, PinReleaseReason.ABORT, now_s=now_s)

    def release_pin(self, job_id: str, reason: PinReleaseReason, *,
                    now_s: float | None = None) -> Pin | None:
        """Releases the job's pin, if any, at `now_s` (None: the clock's now); returns it."""
        return self._pins.release(job_id, reason,
                                  now_s=self.clock() if now_s is None else now_s)

    def end_job(
        self, job_id: str, reason: PinReleaseReason = PinReleaseReason.RELEASE, *,
        now_s: float | None = None,
    ) -> Pin | None:
        """Ends a job at `now_s` (None: the clock's now): releases its pin (if any), forgets
        its turn in the job inference table (if it is an inferred job) and tells the policy;
        returns the pin."""
        now_s = self.clock() if now_s is None else now_s
        pin = self.release_pin(job_id, reason, now_s=now_s)
        if self._job_inference is not None:
            self._job_inference.forget(job_id)
        self.policy.on_job_ended(job_id, now_s)
        self.events.emit(events.JobEnded(job_id, reason.value, now_s))
        return pin

    def close_subscribers(self) -> None:
        """Closes every subscriber of the event stream (a tracer flushes and closes its
        file); none receives anything more."""
        self.events.close()

    def reset_prefix_cache(self) -> bool:
        """Forgets all cached prefixes, the host tier's too; False (no change) while any
        block is held."""
        return self.kv_cache_manager.block_pool.reset_prefix_cache()

    # Scheduling.
    def _schedule_running(self, plan: StepPlan, now_s: float) -> None:
        index = 0
        while index < len(self._running) and plan.token_budget > 0:
            request = self._running[index]
            num_new_tokens = self._num_new_tokens(request, request.num_computed_tokens, plan)
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
        itself was preempted, or waits this step (the policy chose no victim: it keeps its
        blocks and computes nothing)."""
        while (new_blocks := self.kv_cache_manager.allocate_slots(request, num_new_tokens)) is None:
            victim = self.policy.select_victim(request, now_s)
            if victim is None:
                return None
            if isinstance(victim, Pin):
                self._release_for_pressure(victim, now_s)
                continue
            if victim.status is not RequestStatus.RUNNING:
                raise RuntimeError(f"policy chose {victim} as a victim, which is not running")
            if self._tenants_compete():
                victim = self._tenant_shares(plan).victim_instead_of(
                    victim, request, self._num_blocks_for(num_new_tokens))
            self._preempt(victim, plan, needed_by=request)
            if victim is request:
                return None
        return new_blocks

    def _sweep_policy(self, now_s: float) -> tuple[str, ...]:
        """Carries out the policy's sweep: releases the pins it says ran out; returns the
        jobs it forgot."""
        decision = self.policy.sweep(now_s)
        self._release_expired(decision.expired_pins, now_s)
        return decision.forgotten_job_ids

    def _expire_pins(self, now_s: float) -> None:
        """Releases (EXPIRED) the pins the policy says are past their end, once the step's
        admissions have had their chance to reuse them."""
        self._release_expired(tuple(self.policy.expired_pins(now_s)), now_s)

    def _release_expired(self, pins: Sequence[Pin], now_s: float) -> None:
        for pin in pins:
            if self._pins.get(pin.job_id) is not pin:
                raise RuntimeError(f"policy expired the pin of job {pin.job_id!r}, which is "
                                   "not live")
            self.release_pin(pin.job_id, PinReleaseReason.EXPIRED, now_s=now_s)

    def _release_for_pressure(self, pin: Pin, now_s: float) -> None:
        if self._pins.get(pin.job_id) is not pin:
            raise RuntimeError(f"policy chose the pin of job {pin.job_id!r}, which is not live")
        self.release_pin(pin.job_id, PinReleaseReason.PRESSURE, now_s=now_s)

    def _preempt(self, request: Request, plan: StepPlan, *, needed_by: Request,
                 reason: events.PreemptionReason = "out_of_blocks") -> None:
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
        if memory_short and not self._tenants_compete():
            return
        passed_over: list[Request] = []
        passed_over_tenants: set[str | None] = set()
        while plan.token_budget > 0:
            request = self._next_waiting(passed_over_tenants)
            if request is None:
                break
            if request in plan.preempted:
                passed_over_tenants.add(request.tenant)
                continue
            admission = self._try_admit(request, plan, now_s, memory_short=memory_short)
            if admission is Admission.NO_MEMORY:
                if not self._passes_share(request, plan):
                    break
                passed_over_tenants.add(request.tenant)
            elif admission is Admission.OVER_BUDGET:
                self._waiting.remove_request(request)
                passed_over.append(request)
        for request in reversed(passed_over):
            self._waiting.prepend_request(request)

    def _try_admit(self, request: Request, plan: StepPlan, now_s: float, *,
                   memory_short: bool) -> Admission:
        """`_admit_taking_share`, unless the step is short of memory and no share can be
        taken back for `request`, or the batch is full and no slot can: then NO_MEMORY."""
        if memory_short and self._share_victim(request, plan) is None:
            return Admission.NO_MEMORY
        if (len(self._running) >= self.config.max_num_seqs
                and not self._preempt_for_share(request, plan)):
            return Admission.NO_MEMORY
        return self._admit_taking_share(request, plan, now_s)

    def _next_waiting(self, passed_over_tenants: set[str | None]) -> Request | None:
        """The next waiting request to try, of a tenant not passed over this step."""
        if passed_over_tenants:
            return self._waiting.peek_request_excluding(passed_over_tenants)
        return self._waiting.peek_request() if self._waiting else None

    def _passes_share(self, request: Request, plan: StepPlan) -> bool:
        """Whether tenants compete and waiting `request` would take its tenant past its
        share."""
        return self._tenants_compete() and not self._tenant_shares(plan).fits_share(
            request.tenant, self._num_blocks_for(request.num_tokens))

    def _admit_taking_share(self, request: Request, plan: StepPlan, now_s: float) -> Admission:
        """`_admit`, preempting for its share (`_preempt_for_share`) while blocks are short.
        A victim may free no block (its prefix is cached for its tenant's other requests);
        the loop ends anyway once no tenant keeps its share without its latest request."""
        admission = self._admit(request, plan, now_s)
        while admission is Admission.NO_MEMORY and self._preempt_for_share(request, plan):
            admission = self._admit(request, plan, now_s)
        return admission

    def _tenants_compete(self) -> bool:
        """Whether requests of two tenants were ever seen: tenants' shares apply then."""
        return len(self._tenants_seen) > 1

    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _tenant_shares(self, plan: StepPlan) -> TenantShares:
        """The running requests' use of the batch and KV pool by tenant, now: a request's
        blocks are those it holds beyond the prefix it found cached at its first admission,
        so that a prefix its tenant's requests share counts about once."""
        req_to_blocks = self.kv_cache_manager.req_to_blocks
        block_size = self.block_size

        def num_blocks_of(request: Request) -> int:
            num_held = len(req_to_blocks.get(request.request_id, ()))
            return max(0, num_held - (request.num_cached_tokens or 0) // block_size)

        return TenantShares.measure(
            self._running, self._waiting.tenants(), num_blocks_of,
            max_num_seqs=self.config.max_num_seqs, num_kv_blocks=self.num_kv_blocks,
            admitted_now={request.request_id for request in plan.admitted})

    def _share_victim(self, request: Request, plan: StepPlan) -> Request | None:
        """The latest request of the tenant furthest over its share, if waiting `request`'s
        tenant stays within its own once admitted and it may run this step (`tenant_shares`);
        else None."""
        if not self._tenants_compete() or self._num_new_tokens(request, 0, plan) == 0:
            return None
        return self._tenant_shares(plan).victim_for_waiting(
            request, self._num_blocks_for(request.num_tokens))

    def _preempt_for_share(self, request: Request, plan: StepPlan) -> bool:
        """Preempts `_share_victim(request)`, if there is one, for waiting `request`;
        whether it did."""
        victim = self._share_victim(request, plan)
        if victim is None:
            return False
        self._preempt(victim, plan, needed_by=request, reason="tenant_share")
        return True

    def _admit(self, request: Request, plan: StepPlan, now_s: float) -> Admission:
        """Moves a waiting request to running if its blocks fit (releasing pins the policy
        offers); its job's pin is released only after it took its own references."""
        kv_cache_manager = self.kv_cache_manager
        hit = kv_cache_manager.get_computed_blocks(request)
        num_new_tokens = self._num_new_tokens(request, hit.num_tokens, plan)
        if num_new_tokens == 0:
            return Admission.OVER_BUDGET
        if not self._can_reserve(request, hit, num_new_tokens, now_s):
            self._release_pins_yielding_to(request, now_s)
            return Admission.NO_MEMORY
        while kv_cache_manager.allocate_slots(request, num_new_tokens, hit) is None:
            pin = self.policy.select_pin_to_release(request, now_s)
            if pin is None:
                return Admission.NO_MEMORY
            self._release_for_pressure(pin, now_s)
            # Storing the released blocks may have evicted host blocks of the hit.
            hit = kv_cache_manager.get_computed_blocks(request)
            num_new_tokens = self._num_new_tokens(request, hit.num_tokens, plan)
            if num_new_tokens == 0:
                return Admission.OVER_BUDGET
        num_hit_tokens = hit.num_tokens
        if request.status is RequestStatus.PREEMPTED:
            dropped = self._dropped_tokens.pop(request.request_id, 0)
            self.recomputed_tokens += max(0, dropped - num_hit_tokens)
        self._waiting.remove_admitted(request)
        self.events.emit(events.Admitted(
            request, hit, self._pins.get(request.job_id or ""),
            resumed=request.status is RequestStatus.PREEMPTED, now_s=now_s,
        ))
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_hit_tokens
            request.first_scheduled_at_s = now_s
        self._running.append(request)
        plan.admitted.append(request)
        plan.add(request, num_new_tokens)
        reused_pin = None
        if request.job_id is not None:
            reused_pin = self.release_pin(request.job_id, PinReleaseReason.REUSED, now_s=now_s)
        self.policy.on_request_admitted(request, reused_pin, now_s)
        return Admission.ADMITTED

    def _release_pins_yielding_to(self, request: Request, now_s: float) -> None:
        """Releases the pins the policy gives up for the blocked waiting head, as when its
        blocks are short, though the head still waits: the memory they free is its next."""
        while (pin := self.policy.select_pin_to_release(request, now_s)) is not None:
            self._release_for_pressure(pin, now_s)

    def _can_reserve(self, request: Request, hit: PrefixHit, num_new_tokens: int,
                     now_s: float) -> bool:
        """Whether the blocks of the tokens the policy wants reserved beyond this step's
        chunk (`num_tokens_to_reserve`) are free or held by the pins the policy lets the
        request's later chunks take (`reservable_pins`). Always True while nothing runs:
        nothing else could free blocks for it then."""
        num_tokens = self.policy.num_tokens_to_reserve(request, hit.num_tokens, num_new_tokens)
        if num_tokens <= num_new_tokens or not self._running:
            return True
        num_needed = self.kv_cache_manager.num_free_blocks_needed(request, num_tokens, hit)
        num_reservable_blocks = 0
        for pin in self.policy.reservable_pins(request, now_s):
            if self._pins.get(pin.job_id) is not pin or pin.job_id == request.job_id:
                raise RuntimeError(f"policy counted the pin of job {pin.job_id!r} as room for "
                                   f"{request.request_id!r}: not live, or its own job's")
            num_reservable_blocks += pin.num_blocks
        num_free_blocks = self.kv_cache_manager.block_pool.num_free_blocks
        return num_needed <= num_free_blocks + num_reservable_blocks

    def _num_new_tokens(self, request: Request, num_computed_tokens: int, plan: StepPlan) -> int:
        """Tokens `request` may compute this step: its remainder, placeholders included (but
        its last token if it is held back), capped by the long-prefill threshold and the
        budget (0 if it must go whole and does not fit, or if the token it awaits will end
        it by length)."""
        if request.num_output_placeholders and self._awaits_last_token(request):
            return 0
        num_new_tokens = request.num_tokens + request.num_output_placeholders - num_computed_tokens
        if request.request_id in plan.held_back:
            num_new_tokens -= 1
        threshold = self.config.long_prefill_token_threshold
        if threshold is not None and num_new_tokens > threshold:
            num_new_tokens = threshold
        if num_new_tokens > plan.token_budget:
            return plan.token_budget if self.config.enable_chunked_prefill else 0
        return num_new_tokens

    def _awaits_last_token(self, request: Request) -> bool:
        """Whether the tokens `request` awaits bring it to `max_model_len` or `max_tokens`."""
        num_tokens = request.num_tokens + request.num_output_placeholders
        max_tokens = request.sampling_params.max_tokens
        return num_tokens >= self.config.max_model_len or (
            max_tokens is not None and num_tokens - request.num_prompt_tokens >= max_tokens)

    def _emit(self, plan: StepPlan, transfers: KVTransfers) -> SchedulerOutput:
        """Ends the step: emits its output (`step_plan.emit`, which also gives each request
        that samples its placeholder) and starts the next step id."""
        output = emit(plan, step_id=self.step_id, finished_req_ids=self._finished_req_ids,
                      block_ids_of=self.kv_cache_manager.get_block_ids, transfers=transfers)
        self._unfinished_steps[self.step_id] = {
            request.request_id: request for request in (*plan.continuing, *plan.admitted)}
        self._finished_req_ids = set()
        self.step_id += 1
        return output

    # Finishing.
    def _retire(self, stopped: list[Request], now_s: float) -> None:
        stopped_ids = {request.request_id for request in stopped}
        running_ids = {request.request_id for request in self._running}
        self._running = [r for r in self._running if r.request_id not in stopped_ids]
        for request in stopped:
            if request.request_id not in running_ids:  # preempted after its step launched
                self._waiting.remove_request(request)
        for request in stopped:
            self._finish(request, request.status, now_s)

    def _finish(self, request: Request, status: RequestStatus, now_s: float) -> None:
        """Final bookkeeping of a request that left running/waiting: pin or free its blocks."""
        request.status = status
        del self._requests[request.request_id]
        self._dropped_tokens.pop(request.request_id, None)
        self._finished_req_ids.add(request.request_id)
        retention = self.policy.on_request_finished(request, now_s)
        self.events.emit(events.RequestFinished(request, now_s))
        if not self._retain(request, retention, now_s):
            self.kv_cache_manager.free(request,
                                       offload=retention is None or retention.offload)
        if request.job is not None and request.job.is_last_step:
            self.end_job(request.job.job_id, PinReleaseReason.JOB_END, now_s=now_s)
        if self._job_inference is not None and request.job is not None and request.job.inferred:
            self._end_jobs(self._job_inference.turn_finished(request, now_s), now_s)

    def _retain(self, request: Request, retention: Retention | None, now_s: float) -> bool:
        """Carries out the policy's retention decision: pins the request's cached blocks if it
        says so; True if the request's blocks were handed to a pin (or freed by detaching)."""
        if retention is None or request.job is None:
            return False
        if request.status is RequestStatus.FINISHED_ABORTED:
            raise RuntimeError(f"policy retained {request}, which was aborted")
        pin = None
        for job_id in retention.release_job_ids:
            self.release_pin(job_id, PinReleaseReason.PRESSURE, now_s=now_s)
        if retention.pins:
            blocks = self.kv_cache_manager.detach_cached_blocks(request)
            if blocks:
                pin = self._pins.add(request.job.job_id, request.request_id, blocks,
                                     now_s=now_s, ttl_s=self._pin_ttl_s(request, retention))
        self.events.emit(events.RetentionDecided(request, pin, retention.inputs, now_s))
        return retention.pins

    def _pin_ttl_s(self, request: Request, retention: Retention) -> float:
        """The policy's TTL, capped for an inferred job by how long its turn can be continued."""
        if self._job_inference is None or request.job is None or not request.job.inferred:
            return retention.ttl_s
        return self._job_inference.pin_ttl_s(retention.ttl_s)

    # Job inference.
    def _infer_job(self, request: Request, now_s: float) -> InferredJob | None:
        """Gives a request without a job its inferred job (None: it has a job, or inference
        is off); an explicit job is never changed."""
        if self._job_inference is None or request.job is not None:
            return None
        inferred = self._job_inference.infer(request, now_s)
        request.job = inferred.job
        return inferred

    def _sweep_inferred_jobs(self, now_s: float) -> list[str]:
        """Ends the inferred jobs whose latest turn aged out; returns their ids."""
        if self._job_inference is None:
            return []
        return self._end_jobs(self._job_inference.sweep(now_s), now_s)

    def _end_jobs(self, job_ids: list[str], now_s: float) -> list[str]:
        """Ends inferred jobs that can no longer be continued (reason JOB_END)."""
        for job_id in job_ids:
            self.end_job(job_id, PinReleaseReason.JOB_END, now_s=now_s)
        return job_ids

    def _on_pin_released(self, pin: Pin) -> None:
        self.policy.on_pin_released(pin)
        self.events.emit(events.PinReleased(pin))

    def check_invariants(self) -> None:
        """Asserts the scheduler's and the KV cache's invariants (`invariants.check_invariants`);
        tests call it every step."""
        invariants.check_invariants(self)
