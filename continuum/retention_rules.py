"""Retention rules: whether a finished, non-final turn of a job keeps its KV pinned, and for
how long.

A `RetentionRule` answers `SchedulingPolicy.retention` for an `AgentPolicy` and learns from
the events the policy receives. Strategy objects an `AgentPolicy` composes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Protocol

from continuum.estimation import (
    GuardedEstimator,
    measured_prefill_cost,
    measured_reload_cost,
    retention_inputs,
    save_estimator,
)
from continuum.interception import InterceptionModel
from continuum.jobs import Job
from continuum.ledger import JobLedger
from engine.request import Request
from engine.scheduler import events
from engine.scheduler.policy import SchedulerView
from engine.scheduler.retention import Retention, RetentionInputs
from engine.tool_calls import ToolCallFormat
from estimator.parsing import ParsedToolCalls, tool_key, without_control_tokens
from estimator.ttl_estimator import ToolCall, TTLEstimator

logger = logging.getLogger(__name__)

# The decision for a turn that called no tool: not pinned.
NO_TOOL_CALL = Retention(0.0, RetentionInputs(ttl_s=0.0, source="no-tool-call"))


class RetentionRule(Protocol):
    """Owned by one policy: `bind` once (with the scheduler it reads), `decide` for every
    finished, non-final turn of a live job (its books not yet updated for the finish),
    `learn` from every event after the policy's books took it, `forget` a job that left the
    books, `close` when the engine stops. A decision of None frees the turn's blocks with
    nothing to explain."""

    def bind(self, scheduler: SchedulerView) -> None: ...

    def decide(self, request: Request, job: Job, now_s: float,
               ledger: JobLedger) -> Retention | None: ...

    def learn(self, event: events.SchedulerEvent, ledger: JobLedger) -> None: ...

    def forget(self, job: Job) -> None: ...

    def close(self) -> None: ...


class NoPins:
    """Never pins (and learns nothing)."""

    def bind(self, scheduler: SchedulerView) -> None:
        pass

    def decide(self, request: Request, job: Job, now_s: float,
               ledger: JobLedger) -> Retention | None:
        return None

    def learn(self, event: events.SchedulerEvent, ledger: JobLedger) -> None:
        pass

    def forget(self, job: Job) -> None:
        pass

    def close(self) -> None:
        pass


class PinUntilNextTurn(NoPins):
    """InferCept's preserve: a turn that called a tool is pinned until its job's next turn is
    admitted, for at most `ttl_s`."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s

    def decide(self, request: Request, job: Job, now_s: float, ledger: JobLedger) -> Retention:
        call = read_tool_call(request, job, now_s, ledger)
        if call is None:
            return NO_TOOL_CALL
        return Retention(self.ttl_s, RetentionInputs(ttl_s=self.ttl_s, source="until-next-turn",
                                                     tool=call.tool_name))


class InterceptedPins(NoPins):
    """InferCept with swap: each turn that called a tool is preserved (pinned for at most
    `ttl_s`), discarded (freed without a store to the host tier) or swapped (freed with a
    store; the next turn loads it back), whichever wastes the least memory-time
    (`continuum.interception`), recompute priced by the prefills and reload by the host-tier
    loads the engine times at start-up."""

    def __init__(self, ttl_s: float, default_tool_duration_s: float) -> None:
        self.ttl_s = ttl_s
        self.default_tool_duration_s = default_tool_duration_s
        self.model: InterceptionModel

    def bind(self, scheduler: SchedulerView) -> None:
        self.model = InterceptionModel(
            recompute_cost=measured_prefill_cost(scheduler.environment),
            reload_cost=measured_reload_cost(scheduler),
            default_tool_duration_s=self.default_tool_duration_s,
        )

    def decide(self, request: Request, job: Job, now_s: float, ledger: JobLedger) -> Retention:
        call = read_tool_call(request, job, now_s, ledger)
        if call is None:
            return NO_TOOL_CALL
        self.model.observe_tool_call(call)
        block_size = ledger.scheduler.block_size
        running_blocks = sum(-(-other.num_computed_tokens // block_size)
                             for other in ledger.scheduler.running if other is not request)
        decision = self.model.decide(call, block_size=block_size,
                                     num_running_blocks=running_blocks)
        ttl_s = self.ttl_s if decision.choice == "preserve" else 0.0
        inputs = RetentionInputs(ttl_s=ttl_s, source=decision.choice, tool=call.tool_name,
                                 num_samples=decision.num_samples, rebuild_s=decision.rebuild_s)
        return Retention(ttl_s, inputs, offload=decision.choice != "discard")

    def learn(self, event: events.SchedulerEvent, ledger: JobLedger) -> None:
        if isinstance(event, events.RequestArrived):
            job = ledger.job_of(event.request)
            if job is not None and job.num_turns_finished > 0:
                self.model.observe_next_turn(job.job_id, event.now_s)

    def forget(self, job: Job) -> None:
        self.model.forget_job(job.job_id)


class EstimatedPins:
    """Continuum's pins: a turn that called a tool is pinned for the estimator's TTL when it
    is positive (Eq. 2 by default). With `max_pinned_fraction` < 1, a new pin first has the
    pins of jobs that arrived later released (latest first), else it is declined. The
    estimator comes from `make_estimator` at `bind` (guarded: its failures cost a pin, never
    a step), learns tool durations, next-turn arrivals, queueing delays and job ends from
    the events, and is saved to `state_file` (if any) when the engine stops."""

    def __init__(self, make_estimator: Callable[[SchedulerView], TTLEstimator], *,
                 max_pinned_fraction: float = 1.0, state_file: str | None = None) -> None:
        self._make_estimator = make_estimator
        self.max_pinned_fraction = max_pinned_fraction
        self.state_file = state_file
        self.estimator: GuardedEstimator

    def bind(self, scheduler: SchedulerView) -> None:
        self.estimator = GuardedEstimator(self._make_estimator(scheduler))

    def decide(self, request: Request, job: Job, now_s: float, ledger: JobLedger) -> Retention:
        call = read_tool_call(request, job, now_s, ledger)
        if call is None:
            return NO_TOOL_CALL
        self.estimator.observe_tool_call(call)
        decision = self.estimator.decide(call)
        inputs = retention_inputs(call, decision)
        if decision.ttl_s <= 0:
            return Retention(decision.ttl_s, inputs)
        released = self._pins_to_make_room(request, call.job_id, ledger)
        if released is None:
            return Retention(0.0, dataclasses.replace(inputs, declined_by="pin-cap"))
        return Retention(decision.ttl_s, inputs, release_job_ids=released)

    def _pins_to_make_room(self, request: Request, job_id: str,
                           ledger: JobLedger) -> tuple[str, ...] | None:
        """The jobs whose pins must go for a new pin of `request`'s blocks to fit under the pin
        cap: those of jobs that arrived after `job_id`'s, latest first; None if it cannot."""
        if self.max_pinned_fraction >= 1:
            return ()
        scheduler = ledger.scheduler
        cap_blocks = self.max_pinned_fraction * scheduler.num_kv_blocks
        pins = ledger.policy_pins()
        needed = request.num_computed_tokens // scheduler.block_size
        held = sum(pin.num_blocks for pin in pins if pin.job_id != job_id)
        rank = ledger.job_arrival_rank(job_id)
        later = sorted((pin for pin in pins if ledger.job_arrival_rank(pin.job_id) > rank),
                       key=lambda pin: ledger.job_arrival_rank(pin.job_id), reverse=True)
        released: list[str] = []
        for pin in later:
            if held + needed <= cap_blocks:
                break
            released.append(pin.job_id)
            held -= pin.num_blocks
        return tuple(released) if held + needed <= cap_blocks else None

    def learn(self, event: events.SchedulerEvent, ledger: JobLedger) -> None:
        match event:
            case events.RequestArrived(request=request, now_s=now_s):
                job = ledger.job_of(request)
                if job is not None and job.num_turns_finished > 0:
                    self.estimator.observe_next_turn(job.job_id, now_s)
            case events.Admitted(request=request, job_pin=job_pin, now_s=now_s):
                job = ledger.job_of(request)
                if (job is not None and job.num_turns_finished > 0 and job_pin is None
                        and request.num_preemptions == 0):
                    self.estimator.observe_queueing_delay(now_s - ledger.arrival(request)[0])

    def forget(self, job: Job) -> None:
        self.estimator.observe_job_end(job.job_id, job.num_turns_finished)

    def close(self) -> None:
        if self.state_file is not None:
            save_estimator(self.estimator, self.state_file)


def read_tool_call(request: Request, job: Job, now_s: float, ledger: JobLedger) -> ToolCall | None:
    """The tool call a finished, non-final turn of `job` made (its books not yet updated for
    the finish), or None if it called no tool: the tool is the client's `tool_name`, else
    parsed from the turn's output."""
    tool_name = _tool_name(request, ledger.scheduler)
    if tool_name is None:
        return None
    scheduler = ledger.scheduler
    others = [other for other in scheduler.running if other is not request]
    pool_tokens = scheduler.block_size * scheduler.num_kv_blocks
    return ToolCall(
        job_id=job.job_id,
        tool_name=tool_name,
        finished_at_s=now_s,
        num_context_tokens=request.num_tokens,
        turn_index=job.num_turns_finished,
        num_running_requests=len(others),
        request_id=request.request_id,
        num_waiting_requests=len(scheduler.waiting),
        pool_share=request.num_computed_tokens / pool_tokens,
        running_pool_share=sum(other.num_computed_tokens for other in others) / pool_tokens,
    )


def _tool_name(request: Request, scheduler: SchedulerView) -> str | None:
    client_name = None if request.job is None else request.job.tool_name
    named = tool_key(None, client_tool_name=client_name)
    decode = scheduler.environment.decode
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


def _returned_tool_key(tool_call_format: ToolCallFormat, text: str) -> str | None:
    """The statistics key of the calls the server returned to the client for `text` (read
    by the request's own parser), or None when it returned none."""
    calls = tool_call_format.make_parser().parse(without_control_tokens(text)).tool_calls
    return ParsedToolCalls(tuple(call.name for call in calls), "server").key if calls else None
