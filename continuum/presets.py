"""The agent policies the engine registers, each a composition of strategies built from its
user options (`PolicyPreset`): `continuum`, `continuum-fixed`, `job-fcfs`, `infercept` and
`autellix`. Historical and ablation compositions live in `eval/policy_variants.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from continuum.admission_rules import (
    LaterJobsPins,
    OtherJobsPins,
    ThisChunk,
    WholePrompt,
    YieldInOrder,
    YieldWhenIdle,
    YieldWhenOverdue,
)
from continuum.agent_policy import AgentPolicy, Strategies
from continuum.estimation import EstimatorChoice, build_estimator
from continuum.policy_options import (
    ContinuumFixedOptions,
    ContinuumOptions,
    InferCeptOptions,
    JobOptions,
    ProgramOrderOptions,
)
from continuum.retention_rules import (
    EstimatedPins,
    InterceptedPins,
    NoPins,
    PinUntilNextTurn,
    RetentionRule,
)
from continuum.victims import (
    LatestAdmitted,
    LatestIdleJobPin,
    LeastWastePin,
    MostServedJob,
    NewestRunning,
    PinsFirst,
)
from continuum.waiting_order import ArrivalOrder, LeastAttainedService, ProgramOrder, WaitingBounds
from engine.scheduler.options import parse_policy_options
from engine.scheduler.policy import SchedulerView
from estimator.cost_model import PrefillCostModel
from estimator.ttl_estimator import TTLEstimator


@dataclass(frozen=True)
class PolicyPreset:
    """A registered agent policy: `name`, its user options (`options_type`, a frozen config
    whose fields carry their help) and how they compose its strategies (`compose`, which
    may take keyword arguments such as a ready `estimator`)."""

    name: str
    options_type: type[JobOptions]
    compose: Callable[..., Strategies]

    def from_options(self, options: Mapping[str, object], **kwargs: Any) -> AgentPolicy:
        """The policy with its `KEY=VALUE` options parsed; ValueError naming a bad one."""
        parsed = parse_policy_options(self.options_type, options,
                                      owner=f"scheduling policy {self.name!r}")
        return self.build(parsed, **kwargs)

    def build(self, options: JobOptions | None = None, **kwargs: Any) -> AgentPolicy:
        """The policy with parsed `options` (None: the defaults)."""
        options = self.options_type() if options is None else options
        return AgentPolicy(self.name, self.compose(options, **kwargs),
                           job_idle_timeout_s=options.job_idle_timeout_s)


def waiting_bounds(options: ProgramOrderOptions) -> WaitingBounds:
    """Agent turns are never overdue (service aging bounds their waits); plain requests are
    after `max_plain_wait_s`."""
    return WaitingBounds(math.inf, options.max_plain_wait_s)


def program_order(options: ProgramOrderOptions, retention: RetentionRule) -> Strategies:
    """Program-level order aged by service, whole-prompt admission, and the latest admitted
    request preempted first; pins (if `retention` makes any) released before any running
    request is preempted, yielding to a blocked waiting head once it is overdue."""
    bounds = waiting_bounds(options)
    order = ProgramOrder(bounds, options.service_weight, options.pin_lead_s)
    return Strategies(
        order=order, retention=retention,
        victims=PinsFirst(LatestIdleJobPin(), LatestAdmitted()),
        admission=WholePrompt(LaterJobsPins(bounds)), pin_yield=YieldWhenOverdue(bounds))


def compose_continuum(options: ContinuumOptions, *, estimator: TTLEstimator | None = None,
                      prefill_cost: PrefillCostModel | None = None) -> Strategies:
    """Continuum: program-level order with pins for the estimator's TTL (`estimator`, when
    given, instead of the one the options name; `prefill_cost`, when given, prices its
    rebuilds instead of the prefills timed at start-up)."""
    choice = EstimatorChoice(options.estimator, max_ttl_s=options.max_ttl_s,
                             state_file=options.estimator_state, prefill_cost=prefill_cost)
    make_estimator: Callable[[SchedulerView], TTLEstimator] = (
        partial(build_estimator, choice) if estimator is None else lambda _: estimator)
    return program_order(options, EstimatedPins(
        make_estimator, max_pinned_fraction=options.max_pinned_fraction,
        state_file=options.estimator_state))


def compose_job_fcfs(options: ProgramOrderOptions) -> Strategies:
    """Program-level FCFS without pins (the first rung of the paper's ablation)."""
    order = ProgramOrder(waiting_bounds(options), options.service_weight, options.pin_lead_s)
    return Strategies(
        order=order, retention=NoPins(),
        victims=LatestAdmitted(), admission=WholePrompt(OtherJobsPins()),
        pin_yield=YieldWhenIdle())


def compose_infercept(options: InferCeptOptions) -> Strategies:
    """InferCept (ICML 2024): FCFS; a turn that called a tool keeps its KV until its job's next
    turn (at most the idle timeout) or, with `swap`, is preserved, discarded or swapped by
    InferCept's waste model; under pressure, from the waiting head or a running request,
    the preserved context cheapest to recompute goes first, before any preemption."""
    ttl_s = options.job_idle_timeout_s
    retention: RetentionRule = (
        InterceptedPins(ttl_s, options.default_tool_duration_s) if options.swap
        else PinUntilNextTurn(ttl_s))
    return Strategies(
        order=ArrivalOrder(), retention=retention,
        victims=PinsFirst(LeastWastePin(), NewestRunning(), spare_own_job=False),
        admission=ThisChunk(),
        pin_yield=YieldInOrder(LeastWastePin()))


def compose_autellix(options: JobOptions) -> Strategies:
    """Autellix (2025): program-level least attained service, the most-served job preempted
    first, no pins (its discretised queues and starvation guard are not modelled)."""
    return Strategies(
        order=LeastAttainedService(), retention=NoPins(), victims=MostServedJob(),
        admission=ThisChunk(), pin_yield=YieldWhenIdle())


CONTINUUM = PolicyPreset("continuum", ContinuumOptions, compose_continuum)
CONTINUUM_FIXED = PolicyPreset("continuum-fixed", ContinuumFixedOptions, compose_continuum)
JOB_FCFS = PolicyPreset("job-fcfs", ProgramOrderOptions, compose_job_fcfs)
INFERCEPT = PolicyPreset("infercept", InferCeptOptions, compose_infercept)
AUTELLIX = PolicyPreset("autellix", JobOptions, compose_autellix)
