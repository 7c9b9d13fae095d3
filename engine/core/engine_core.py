"""The engine core: one scheduler and one executor, advanced one step at a time.

Torch-free: the executor is created by name and may be a cost model. Used directly by the
in-process client, and inside `EngineCoreProc` for the multiprocess clients.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import msgspec

from engine.clock import Clock
from engine.config import EngineConfig, SchedulerConfig
from engine.core.malloc_thresholds import release_free_heap
from engine.core.wire import EngineCoreRequest, EngineStats, JobState, PinState
from engine.executor.base import Executor, KVReloadProfiler, PrefillProfiler, make_executor
from engine.kv_cache.pins import PinReleaseReason
from engine.model.tokenizer import load_decoder, tokenizer_dir
from engine.outputs import EngineCoreOutput, PendingStep
from engine.request import FinishReason, Request
from engine.scheduler.output import SchedulerOutput
from engine.scheduler.policy import PolicyEnvironment, SchedulingPolicy
from engine.scheduler.policy_registry import make_policy
from engine.scheduler.scheduler import Scheduler, Sweep
from engine.scheduler.tracer import SchedulerTracer
from engine.structured_output.output_manager import GrammarFailure, StructuredOutputManager
from engine.structured_output.tokenizer import GrammarTokenizerSource, read_grammar_tokenizer

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.05  # how long an idle step waits for a grammar compile or mask to finish


class EngineCore:
    """Owns the scheduler and the executor; every call comes from one thread.

    `add_request` and `abort_requests` may be called between steps; `step` runs one scheduler
    step through the executor and returns the outputs it produced, when `has_work`; `sweep`
    does the time-driven upkeep (pin expiry, idle jobs) while there is none. The utility
    methods named in `UTILITIES` may be called remotely (`UtilityCall`).

    A request with a structured output is held back while its grammar compiles on a worker
    thread (`structured_outputs`), then queued. Masks are computed on worker threads too: a
    constrained request whose mask is not ready when a step starts sits that step out, and
    one whose grammar is too slow or too large fails alone. Each step sends the runner the
    token masks of the constrained requests that sample, and advances their grammars by what
    they produced.

    With async scheduling (`SchedulerConfig.async_scheduling`, or where that is None the
    executor's `prefers_async_scheduling` without a host KV tier: `async_scheduling` here) a
    step is scheduled and submitted before the previous step's result is taken, so that the
    host's work of a step (the previous result, the schedule, the next inputs) overlaps the
    device's: one step stays in flight between calls. A step whose requests have a
    structured output is taken before the next is scheduled, since their next masks need its
    tokens.
    """

    UTILITIES = frozenset({
        "stats", "reset_prefix_cache", "release_job", "job_state", "check_invariants",
        "prepare_grammars",
    })

    def __init__(
        self,
        config: EngineConfig,
        *,
        executor: Executor | None = None,
        policy: SchedulingPolicy | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.clock = clock
        self.executor = make_executor(config) if executor is None else executor
        # The resolved value, so that the trace's header says which mode ran.
        config = replace(config, scheduler=replace(
            config.scheduler, async_scheduling=self._resolve_async_scheduling(config)))
        self.config = config
        self.num_steps = 0
        self.scheduler = Scheduler(
            config.scheduler, config.cache,
            make_policy(config.scheduler.policy, config.scheduler.policy_options)
            if policy is None else policy,
            num_kv_blocks=self.executor.num_kv_blocks,
            num_host_kv_blocks=self.executor.num_host_kv_blocks, clock=clock,
            environment=self._policy_environment(),
            tracer=None if config.trace.path is None else SchedulerTracer(
                config.trace.path, config=config, max_bytes=config.trace.max_bytes,
            ),
        )
        self.vocab_size = self.executor.vocab_size
        self.structured_outputs = StructuredOutputManager(
            functools.partial(_read_grammar_tokenizer, config.model.model, config.model.tokenizer),
            self.vocab_size, config=config.structured_output, release_heap=release_free_heap)
        self._compiling: dict[str, Request] = {}  # held back until their grammar compiled
        self._in_flight: _InFlightStep | None = None  # submitted, its result not yet taken
        self.step_time_s = 0.0
        self.execute_time_s = 0.0
        self.submit_time_s = 0.0  # the part of execute_time_s in `executor.submit`
        self.kv_copy_time_s = 0.0
        self.num_invariant_checks = 0

    @property
    def async_scheduling(self) -> bool:
        """Whether a step is scheduled before the last one's tokens are read (the config's
        value, resolved at construction)."""
        return bool(self.config.scheduler.async_scheduling)

    def _resolve_async_scheduling(self, config: EngineConfig) -> bool:
        """`SchedulerConfig.async_scheduling`, or where it is None what the executor prefers
        (not with a host KV tier). An executor from a `module:Class` path that does not say
        (`prefers_async_scheduling` absent) runs its steps in order."""
        if config.scheduler.async_scheduling is not None:
            return config.scheduler.async_scheduling
        prefers = getattr(self.executor, "prefers_async_scheduling", False)
        return bool(prefers) and not config.cache.kv_offload_gib

    def _policy_environment(self) -> PolicyEnvironment:
        executor = self.executor
        profile_prefill = None
        if isinstance(executor, PrefillProfiler):
            profile_prefill = _ProfileOnceBeforeServing(
                functools.partial(executor.profile_prefill,
                                  prefill_profile_lengths(self.config.scheduler)),
                is_serving=lambda: self.num_steps > 0,
            )
        profile_kv_reload = None
        if executor.num_host_kv_blocks and isinstance(executor, KVReloadProfiler):
            profile_kv_reload = _ProfileOnceBeforeServing(
                functools.partial(executor.profile_kv_reload,
                                  prefill_profile_lengths(self.config.scheduler)),
                is_serving=lambda: self.num_steps > 0,
            )
        return PolicyEnvironment(profile_prefill=profile_prefill,
                                 decode=load_decoder(self.config.model.model,
                                                     self.config.model.tokenizer),
                                 profile_kv_reload=profile_kv_reload)

    def wake(self) -> None:
        """Ends a step's wait for grammars (`GRAMMAR_WAIT_S`) at once. Thread-safe: the core
        process's input thread calls it for every message it queues, so that a request
        arriving while the core waits for another's compile is taken in at once."""
        self.structured_outputs.wake()

    def prepare_grammars(self, eos_token_id: int | None) -> bool:
        """Builds the tokenizer of the grammars of requests whose EOS is `eos_token_id` now,
        rather than when the first grammar arrives (see `StructuredOutputManager.prepare`).
        A served frontend calls it once at start-up, before it takes requests, with the EOS
        it gives them (`InputProcessor.eos_token_id`). Returns whether it was built; a
        failure is logged, and grammars then fail at compile as they would have."""
        try:
            self.structured_outputs.prepare(eos_token_id)
        except Exception as error:  # a model whose tokenizer llguidance cannot read
            logger.warning("grammars cannot be prepared: %s", error)
            return False
        return True

    def add_request(self, core_request: EngineCoreRequest) -> None:
        """Queues a request (after its grammar compiled, if it has one); ValueError (and no
        change) if it is invalid for this engine."""
        request = self._to_request(core_request)
        spec = request.sampling_params.structured_output
        if spec is None:
            self.scheduler.add_request(request)
            return
        self.scheduler.check_new_request(request)
        if request.request_id in self._compiling:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.structured_outputs.submit(request.request_id, spec, request.eos_token_id,
                                       request.tenant)
        self._compiling[request.request_id] = request

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._compiling.pop(request_id, None)
        self.structured_outputs.remove(request_ids)
        self.scheduler.finish_requests(request_ids)

    @property
    def num_waiting_requests(self) -> int:
        """Requests queued for admission (new, or preempted to be recomputed), and those whose
        grammar compiles."""
        return len(self.scheduler.waiting) + len(self._compiling)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._compiling)

    def has_work(self) -> bool:
        """Whether a step would do anything: unfinished requests to run or to compile, or
        host-tier copies queued (an idle engine still completes its stores). Pins and job
        books that only wait for time to pass are `sweep`'s, which runs no model step."""
        return (self.has_unfinished_requests() or self.scheduler.has_pending_kv_transfers()
                or self._in_flight is not None)

    def sweep(self) -> Sweep:
        """Time-driven upkeep without a step: releases pins whose TTL ran out and lets the
        policy forget jobs idle past its timeout; returns what it released and forgot.

        Every step does the same at its start; callers run this while `has_work` is False
        (the core process at most every `EngineCoreProc.SWEEP_INTERVAL_S` seconds), so that
        pins and idle jobs expire when no request arrives. With `debug_check_invariants`, a
        sweep that changed anything is followed by an invariant check."""
        sweep = self.scheduler.sweep()
        if sweep and self.config.debug_check_invariants:
            self.check_invariants()
        return sweep

    def step(self) -> list[EngineCoreOutput]:
        """Schedules one step (the policy's step start included), submits it, and applies
        the sampled tokens of the step it completes (this one, or with async scheduling the
        previous one); returns the outputs of the requests that produced tokens. With
        `debug_check_invariants`, a broken invariant raises AssertionError after the step."""
        started_s = time.perf_counter()
        outputs = self._queue_compiled()
        scheduler = self.scheduler
        if scheduler.has_unfinished_requests() or scheduler.has_pending_kv_transfers():
            outputs += self._schedule_and_submit()
        elif self._in_flight is not None:
            outputs += self._take_in_flight()  # the last step out: nothing new to schedule
        else:
            self.structured_outputs.wait_for_work(GRAMMAR_WAIT_S)
            return outputs
        self.step_time_s += time.perf_counter() - started_s
        if self.config.debug_check_invariants:
            self.check_invariants()
        return outputs

    def _schedule_and_submit(self) -> list[EngineCoreOutput]:
        """Schedules and submits one step, and applies the tokens of the step it completes
        (this one, or with async scheduling the one in flight before it)."""
        outputs: list[EngineCoreOutput] = []
        if self._in_flight is not None and self._needs_tokens_first(self._in_flight):
            outputs += self._take_in_flight()
        held_back, failed = self._await_masks()
        outputs += failed
        scheduler_output = self._with_grammar_bitmask(
            self.scheduler.schedule(held_back=held_back))
        previous, self._in_flight = self._in_flight, self._submit(scheduler_output)
        if previous is not None:
            outputs += self._take(previous)
        if not self.async_scheduling:
            outputs += self._take_in_flight()
        if scheduler_output.is_empty and held_back:
            self.structured_outputs.wait_for_work(GRAMMAR_WAIT_S)
        self.num_steps += 1
        return outputs

    def _submit(self, scheduler_output: SchedulerOutput) -> _InFlightStep:
        started_s = time.perf_counter()
        pending = self.executor.submit(scheduler_output)
        submit_s = time.perf_counter() - started_s
        self.execute_time_s += submit_s
        self.submit_time_s += submit_s
        return _InFlightStep(scheduler_output, pending)

    def _take_in_flight(self) -> list[EngineCoreOutput]:
        step, self._in_flight = self._in_flight, None
        return [] if step is None else self._take(step)

    def _take(self, step: _InFlightStep) -> list[EngineCoreOutput]:
        """Waits for a submitted step's tokens and applies them (grammars advanced)."""
        started_s = time.perf_counter()
        runner_output = step.pending.result()
        self.execute_time_s += time.perf_counter() - started_s
        self.kv_copy_time_s += runner_output.kv_copy_time_s
        outputs = self.scheduler.update_from_output(step.scheduler_output, runner_output)
        return self._advance_grammars(outputs)

    def _needs_tokens_first(self, step: _InFlightStep) -> bool:
        """Whether a request of the step in flight has a grammar, whose next mask needs the
        tokens of that step."""
        manager = self.structured_outputs
        return manager.has_grammars and any(
            manager.has_grammar(req_id) for req_id in step.scheduler_output.num_scheduled_tokens)

    def shutdown(self) -> None:
        """Stops the engine: the policy saves what it keeps, and a step still in flight is
        waited for (its tokens dropped) before the executor frees the caches it reads."""
        in_flight, self._in_flight = self._in_flight, None
        try:
            self.structured_outputs.shutdown()
            self.scheduler.close_subscribers()
        finally:
            self._stop_executor(in_flight)

    def _stop_executor(self, in_flight: _InFlightStep | None) -> None:
        try:
            if in_flight is not None:
                in_flight.pending.result()
        except Exception:
            logger.exception("the step in flight at shutdown failed")
        finally:
            self.executor.shutdown()

    # Structured outputs.
    def _queue_compiled(self) -> list[EngineCoreOutput]:
        """Queues the requests whose grammar compiled; rejects those whose compile failed."""
        rejected = []
        for outcome in self.structured_outputs.pop_compiled():
            request = self._compiling.pop(outcome.request_id)
            if outcome.failure is None:
                self.scheduler.add_request(request)
            else:
                rejected.append(_failed(outcome.failure))
        return rejected

    def _await_masks(self) -> tuple[frozenset[str], list[EngineCoreOutput]]:
        """The constrained requests whose mask is not ready (they sit this step out), and the
        outputs ending those whose grammar proved too slow."""
        if not self.structured_outputs.has_grammars:
            return frozenset(), []
        masks = self.structured_outputs.await_masks()
        failed = [failure.request_id for failure in masks.failures]
        if failed:
            self.scheduler.finish_requests(failed)
        return masks.held_back, [_failed(failure) for failure in masks.failures]

    def _with_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> SchedulerOutput:
        """The plan, with the masks of the constrained requests that sample in this step (a
        request samples when the step computes its last known token)."""
        manager = self.structured_outputs
        if not manager.has_grammars:
            return scheduler_output
        requests = self.scheduler.requests
        sampling = [
            req_id for req_id in scheduler_output.num_scheduled_tokens
            if manager.has_grammar(req_id)
            and requests[req_id].num_computed_tokens >= requests[req_id].num_tokens
        ]
        bitmask = manager.bitmask(sampling)
        if bitmask is None:
            return scheduler_output
        return msgspec.structs.replace(scheduler_output, grammar_bitmask=bitmask)

    def _advance_grammars(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Feeds the sampled tokens to their grammars; a request whose tokens the grammar
        rejects (a broken mask) is aborted with the error rather than returned unconstrained."""
        manager = self.structured_outputs
        if not manager.has_grammars:
            return outputs
        advanced = []
        for output in outputs:
            failure = manager.accept(output.request_id, output.new_token_ids,
                                     finished=output.finish_reason is not None)
            if failure is not None:
                self.abort_requests([output.request_id])
                output = _failed(failure)
            advanced.append(output)
        return advanced

    # Utilities.
    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        pool = scheduler.kv_cache_manager.block_pool
        prefix_stats = scheduler.kv_cache_manager.stats
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_kv_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free_blocks,
            kv_usage=pool.usage,
            num_pins=len(scheduler.pins),
            num_pinned_blocks=scheduler.pins.num_pinned_blocks,
            num_preemptions=scheduler.num_preemptions,
            recomputed_tokens=scheduler.recomputed_tokens,
            prefix_cache_query_tokens=prefix_stats.num_query_tokens,
            prefix_cache_hit_tokens=prefix_stats.num_hit_tokens,
            num_steps=self.num_steps,
            step_time_s=self.step_time_s,
            execute_time_s=self.execute_time_s,
            submit_time_s=self.submit_time_s,
            num_pins_created=scheduler.pins.num_created,
            num_cpu_threads=self.executor.num_cpu_threads,
            async_scheduling=self.async_scheduling,
            pins_released={
                reason.value: count for reason, count in scheduler.pins.num_released.items()
            },
            num_jobs=scheduler.policy.num_jobs,
            num_jobs_created=scheduler.policy.num_jobs_created,
            num_jobs_inferred=scheduler.num_jobs_inferred,
            jobs_ended=scheduler.num_jobs_ended,
            pins_created=dict(scheduler.pins.num_created_by_source),
            num_invariant_checks=self.num_invariant_checks,
            num_grammar_compiles=self.structured_outputs.num_compiles,
            num_grammar_cache_hits=self.structured_outputs.num_cache_hits,
            grammar_compile_time_s=self.structured_outputs.compile_time_s,
            grammar_mask_time_s=self.structured_outputs.mask_time_s,
            **self._host_tier_stats(),
        )

    def _host_tier_stats(self) -> dict[str, int | float]:
        host_tier = self.scheduler.kv_cache_manager.host_tier
        if host_tier is None:
            return {}
        block_size = self.scheduler.block_size
        return {
            "num_host_kv_blocks": host_tier.num_blocks,
            "num_used_host_kv_blocks": host_tier.num_used_blocks,
            "host_kv_stored_tokens": host_tier.stats.num_stored_blocks * block_size,
            "host_kv_loaded_tokens": host_tier.stats.num_loaded_blocks * block_size,
            "prefix_cache_host_hit_tokens":
                self.scheduler.kv_cache_manager.stats.num_host_hit_tokens,
            "kv_copy_time_s": self.kv_copy_time_s,
        }

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def release_job(self, job_id: str) -> bool:
        """Ends the job's state in the core (its pin is released); True if it held a pin."""
        if not isinstance(job_id, str) or not job_id:
            raise ValueError(f"job_id must be a non-empty string, got {job_id!r}")
        return self.scheduler.end_job(job_id, PinReleaseReason.RELEASE) is not None

    def job_state(self, job_id: str) -> JobState | None:
        """The job's unfinished turns, pin and policy books; None if the core holds nothing
        for it."""
        if not isinstance(job_id, str) or not job_id:
            raise ValueError(f"job_id must be a non-empty string, got {job_id!r}")
        scheduler = self.scheduler
        num_requests = sum(
            1 for request in scheduler.requests.values() if request.job_id == job_id
        )
        pin = scheduler.pins.get(job_id)
        policy_state = scheduler.policy.job_state(job_id)
        if pin is None and num_requests == 0 and policy_state is None:
            return None
        pin_state = None if pin is None else PinState(
            request_id=pin.request_id, num_blocks=pin.num_blocks, ttl_s=pin.ttl_s,
            remaining_ttl_s=max(0.0, pin.deadline_s - self.clock()), source=pin.source,
        )
        return JobState(job_id=job_id, num_unfinished_requests=num_requests, pin=pin_state,
                        policy=policy_state)

    def check_invariants(self) -> bool:
        """Asserts the scheduler and KV invariants (AssertionError names the broken one)."""
        self.scheduler.check_invariants()
        grammars = self.structured_outputs
        assert grammars.compiling_request_ids == self._compiling.keys(), (
            "the requests held back differ from the grammars being compiled")
        stale = grammars.request_ids - self.scheduler.requests.keys()
        assert not stale, f"grammars of finished requests remain: {sorted(stale)}"
        self.num_invariant_checks += 1
        return True

    def _to_request(self, core_request: EngineCoreRequest) -> Request:
        params = core_request.sampling_params
        if params.n != 1:
            raise ValueError(f"the core runs one sequence per request; got n={params.n}")
        token_ids = core_request.prompt_token_ids
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        eos_token_id = core_request.eos_token_id
        if eos_token_id is not None and not 0 <= eos_token_id < self.vocab_size:
            raise ValueError(f"eos_token_id {eos_token_id} is outside the vocabulary")
        sampler_ids = [*params.stop_token_ids, *(token for token, _ in params.logit_bias)]
        if any(token >= self.vocab_size for token in sampler_ids):
            raise ValueError("stop_token_ids and logit_bias must name tokens in "
                             f"[0, {self.vocab_size})")
        arrival_time_s = core_request.arrival_time_s
        return Request(
            core_request.request_id, token_ids, params,
            arrival_time_s=self.clock() if arrival_time_s is None else arrival_time_s,
            eos_token_id=eos_token_id,
            priority=core_request.priority,
            job=core_request.job,
            cache_salt=core_request.cache_salt,
            tenant=core_request.tenant,
            continues_request_id=core_request.continues_request_id,
            tool_call_format=core_request.tool_call_format,
        )


@dataclass(frozen=True)
class _InFlightStep:
    """A step submitted to the executor whose result the scheduler has not applied."""

    scheduler_output: SchedulerOutput
    pending: PendingStep


def _read_grammar_tokenizer(model: str, tokenizer: str | None) -> GrammarTokenizerSource:
    return read_grammar_tokenizer(tokenizer_dir(model, tokenizer))


def _failed(failure: GrammarFailure) -> EngineCoreOutput:
    return EngineCoreOutput(request_id=failure.request_id, new_token_ids=[],
                            finish_reason=FinishReason.ABORT, error=failure.error,
                            error_param=failure.param)


def prefill_profile_lengths(config: SchedulerConfig) -> list[int]:
    """Prompt lengths to time at start-up: 16, 64, 256, ... up to the longest prefill one step
    can run whole."""
    longest = min(config.max_num_batched_tokens, config.max_model_len)
    lengths = [16]
    while lengths[-1] * 4 < longest:
        lengths.append(lengths[-1] * 4)
    return [*lengths, longest] if longest > lengths[-1] else lengths


class _ProfileOnceBeforeServing:
    """Times prefills at most once, and only before the first step (the profile writes into
    the KV pool, where no request holds blocks until a step schedules one); later calls get
    the first result."""

    def __init__(self, profile: Callable[[], list[tuple[int, float]]],
                 is_serving: Callable[[], bool]) -> None:
        self._profile = profile
        self._is_serving = is_serving
        self._points: list[tuple[int, float]] | None = None

    def __call__(self) -> list[tuple[int, float]]:
        if self._points is None:
            if self._is_serving():
                raise RuntimeError("prefills can only be profiled before serving starts")
            self._points = self._profile()
        return list(self._points)
