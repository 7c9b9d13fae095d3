"""Policies the simulator and the calibration checks still run but the engine does not offer:
the oracle bound and Continuum as earlier measured runs ran it. Each is a `PolicyPreset`
(a composition of `continuum`'s strategies), named in `EVAL_POLICIES` so that `bench sim
--policies` and `python -m lab check-calibration` take it by name like a registered policy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from continuum.admission_rules import (
    LaterJobsPins,
    OtherJobsPins,
    ThisChunk,
    WholePrompt,
    YieldWhenOverdue,
)
from continuum.agent_policy import Strategies
from continuum.estimation import EstimatorChoice, EstimatorWrapper, build_estimator
from continuum.ledger import JobLedger
from continuum.policy_options import ContinuumOptions, option_setting
from continuum.presets import PolicyPreset, program_order
from continuum.queues import ProgramOrderQueue
from continuum.retention_rules import EstimatedPins
from continuum.waiting_order import WaitingBounds
from engine.request import Request
from engine.scheduler.policy import SchedulerView, Victim
from engine.scheduler.request_queue import QueueKey
from estimator.ttl_estimator import ToolCall, TTLDecision, TTLEstimator

# A pin must outlast the next turn's arrival at exactly `finish + duration`.
ORACLE_SLACK_S = 1e-3

ToolDurationLookup = Callable[[str], float | None]


class OracleTTLEstimator(EstimatorWrapper):
    """Eq. 2 with the call's duration known: pins for exactly that duration when the saving
    `T * eta + R` exceeds it, else not at all (`tool_duration_s(request_id)`, None when
    unknown: then `inner` decides); everything observed goes to `inner`, which supplies
    the saving."""

    def __init__(self, inner: TTLEstimator, tool_duration_s: ToolDurationLookup) -> None:
        super().__init__(inner)
        self._tool_duration_s = tool_duration_s

    def decide(self, call: ToolCall) -> TTLDecision:
        decision = self.inner.decide(call)
        duration_s = None if call.request_id is None else self._tool_duration_s(call.request_id)
        if duration_s is None or decision.benefit_s is None:
            return decision
        ttl_s = duration_s + ORACLE_SLACK_S if duration_s < decision.benefit_s else 0.0
        return TTLDecision(ttl_s, "oracle", num_samples=decision.num_samples,
                           queueing_delay_s=decision.queueing_delay_s, eta=decision.eta,
                           rebuild_s=decision.rebuild_s, benefit_s=decision.benefit_s)


def compose_oracle(options: ContinuumOptions, *,
                   tool_duration_s: ToolDurationLookup | None = None) -> Strategies:
    """`continuum` whose TTLs know each tool call's true duration (`tool_duration_s` maps a
    finished turn's request id to it; only the simulator has them): the upper bound for any
    TTL rule."""
    if tool_duration_s is None:
        raise ValueError("continuum-oracle needs every tool call's true duration "
                         "(tool_duration_s); only the simulator (bench sim) has them")
    choice = EstimatorChoice(options.estimator, max_ttl_s=options.max_ttl_s,
                             state_file=options.estimator_state)

    def make_estimator(scheduler: SchedulerView) -> TTLEstimator:
        return OracleTTLEstimator(build_estimator(choice, scheduler), tool_duration_s)

    return program_order(options, EstimatedPins(
        make_estimator, max_pinned_fraction=options.max_pinned_fraction,
        state_file=options.estimator_state))


def compose_as_replayed(options: WaitBoundOptions) -> Strategies:
    """`continuum` as the H100 agent replays of 24b013d and d8b9e2f ran it: the wait
    bounds, the paper's cold start (K = 100), the memory price not yet capped by the pool's
    capacity, and any other job's pin counted as room for a waiting prompt's later
    chunks."""
    choice = EstimatorChoice(options.estimator, max_ttl_s=options.max_ttl_s,
                             pin_cost="priced", cold_start_samples=100)
    strategies = wait_bounded_order(options, EstimatedPins(
        lambda scheduler: build_estimator(choice, scheduler),
        max_pinned_fraction=options.max_pinned_fraction))
    return dataclasses.replace(strategies, admission=WholePrompt(OtherJobsPins()))


def compose_wait_bounded(options: WaitBoundOptions) -> Strategies:
    """`continuum` as of 9c07ba7, the last engine with the wait bounds."""
    choice = EstimatorChoice(options.estimator, max_ttl_s=options.max_ttl_s,
                             state_file=options.estimator_state)
    return wait_bounded_order(options, EstimatedPins(
        partial(build_estimator, choice), max_pinned_fraction=options.max_pinned_fraction,
        state_file=options.estimator_state))


@dataclass(frozen=True)
class WaitBoundOptions(ContinuumOptions):
    """`continuum`'s options as engines before service aging ran them (up to 9c07ba7): a
    turn sorts by its job's first arrival but by no time more than `max_job_age_s` before
    its own, and a request that waited `max_wait_s` heads the queue in arrival order."""

    max_job_age_s: float = field(default=60.0, metadata=option_setting(
        "seconds >= 0: a turn sorts by its job's first arrival, at most this much before "
        "its own"))
    max_wait_s: float = field(default=30.0, metadata=option_setting(
        "seconds >= 0: a request waiting this long goes first, and pins yield to it"))


def wait_bounds(options: WaitBoundOptions) -> WaitingBounds:
    return WaitingBounds(options.max_wait_s, options.max_plain_wait_s)


def wait_bounded_order(options: WaitBoundOptions, retention: EstimatedPins) -> Strategies:
    """`continuum`'s strategies with the order, admission and pin yield of the wait bounds."""
    bounds = wait_bounds(options)
    strategies = program_order(options, retention)
    return dataclasses.replace(
        strategies, order=AgedJobOrder(bounds, options.max_job_age_s, plain_tier=True),
        admission=WholePrompt(LaterJobsPins(bounds)), pin_yield=YieldWhenOverdue(bounds))


@dataclass(frozen=True)
class Af226d3Options(WaitBoundOptions):
    """`continuum`'s options with af226d3's defaults: pins capped at 80 % of the pool, no
    bound of their own for requests without a job."""

    max_plain_wait_s: float = field(default=math.inf, metadata=option_setting(
        "seconds (inf: af226d3 ordered requests without a job like turns)"))
    max_pinned_fraction: float = field(default=0.8, metadata=option_setting(
        "in (0, 1]: the share of the KV pool pins may hold (af226d3: 0.8)"))


@dataclass(frozen=True)
class AgedJobOrder:
    """Program-level order in tiers with the wait bounds, a turn sorting by its job's first
    arrival but by no time more than `max_job_age_s` before its own; with `plain_tier`,
    requests without a job in a tier of their own, else keyed like turns."""

    bounds: WaitingBounds
    max_job_age_s: float
    plain_tier: bool = False
    ages_by_service = False

    def new_queue(self, ledger: JobLedger) -> ProgramOrderQueue:
        def key(request: Request) -> QueueKey:
            first_arrival_s, job_rank, rank = ledger.job_order(request)
            floor_s = ledger.arrival(request)[0] - self.max_job_age_s
            return ((first_arrival_s, job_rank, rank) if first_arrival_s >= floor_s
                    else (floor_s, rank, rank))

        return ProgramOrderQueue(
            key, ledger.arrival, lambda: [pin.job_id for pin in ledger.scheduler.pins],
            self.bounds.overdue_cutoffs, is_plain=ledger.is_plain if self.plain_tier else None)


@dataclass(frozen=True)
class LatestJobVictimPinsLast:
    """af226d3's victims: running requests are preempted before any pin is released (the
    latest job's request, requests of jobs holding a pin last, prefilling or not, however
    often preempted); the latest job's pin (its own last) goes only when the requester
    would preempt itself."""

    def select(self, request: Request, now_s: float, ledger: JobLedger) -> Victim | None:
        def rank(running: Request) -> QueueKey:
            return (running.job_id not in ledger.scheduler.pins, ledger.job_rank(running),
                    ledger.arrival_order(running))

        victim = max(ledger.scheduler.running, key=rank)
        if victim is request:
            pin = ledger.latest_job_pin(exclude_job_id=request.job_id)
            if pin is not None:
                return pin
        return victim


def compose_af226d3(options: Af226d3Options, *,
                    estimator: TTLEstimator | None = None) -> Strategies:
    """`continuum` as commit af226d3 ran it on the H100: Eq. 2 with the paper's R (the
    prefill alone), cold start (K = 100) and pin cost (its TTL); victims before pins
    (`LatestJobVictimPinsLast`); pins yield to a blocked head only when nothing runs or once
    it waited `max_wait_s`; a prompt starts once its first chunk fits; requests without a
    job ordered like turns (`estimator`, when given, instead of the one the options name).
    Pins expire by the scheduler's rule: af226d3 also kept a pin past its deadline while its
    job's turn waited, which is not modelled."""
    choice = EstimatorChoice(options.estimator, max_ttl_s=options.max_ttl_s,
                             state_file=options.estimator_state, rebuild_cost="prefill",
                             pin_cost="ttl", cold_start_samples=100)
    bounds = wait_bounds(options)

    def make_estimator(scheduler: SchedulerView) -> TTLEstimator:
        return build_estimator(choice, scheduler) if estimator is None else estimator

    return Strategies(
        order=AgedJobOrder(bounds, options.max_job_age_s),
        retention=EstimatedPins(make_estimator, max_pinned_fraction=options.max_pinned_fraction,
                                state_file=options.estimator_state),
        victims=LatestJobVictimPinsLast(), admission=ThisChunk(),
        pin_yield=YieldWhenOverdue(bounds))


CONTINUUM_ORACLE = PolicyPreset("continuum-oracle", ContinuumOptions, compose_oracle)
CONTINUUM_AS_REPLAYED = PolicyPreset("continuum-as-replayed", WaitBoundOptions,
                                     compose_as_replayed)
CONTINUUM_AF226D3 = PolicyPreset("continuum-af226d3", Af226d3Options, compose_af226d3)
CONTINUUM_9C07BA7 = PolicyPreset("continuum-9c07ba7", WaitBoundOptions, compose_wait_bounded)

# The names `bench sim --policies` and `python -m lab check-calibration` take beside the engine's.
EVAL_POLICIES = {
    "continuum-oracle": "eval.policy_variants:CONTINUUM_ORACLE",
    "continuum-af226d3": "eval.policy_variants:CONTINUUM_AF226D3",
    "continuum-as-replayed": "eval.policy_variants:CONTINUUM_AS_REPLAYED",
    "continuum-9c07ba7": "eval.policy_variants:CONTINUUM_9C07BA7",
}
