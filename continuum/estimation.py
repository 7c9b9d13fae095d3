"""Building a policy's TTL estimator from what the engine offers (`PolicyEnvironment`)."""

from __future__ import annotations

import logging

from engine.request import Request
from engine.scheduler.policy import PolicyEnvironment
from engine.scheduler.tracer import finite_or_none
from estimator.base import ToolCall, TTLEstimator
from estimator.cost_model import PrefillCostModel, read_prefill_profile
from estimator.eq2 import Eq2Estimator
from estimator.parsing import tool_key
from estimator.registry import make_estimator, warm_start
from estimator.traces import read_trace_jobs
from tracing.records import TTLInputs

logger = logging.getLogger(__name__)


def estimator_from_environment(environment: PolicyEnvironment) -> TTLEstimator:
    """The configured estimator: the saved state if one loads, else warm-started from the
    traces (a saved state already holds what an earlier warm start taught); then `R` priced
    by the measured or given prefill profile (`none`: R = 0). ValueError if the name, a
    trace or the profile file is bad; a corrupt state file only warns."""
    config = environment.estimator
    estimator = make_estimator(config.name)
    loaded = (config.state_path is not None and isinstance(estimator, Eq2Estimator)
              and estimator.load_or_cold_start(config.state_path))
    if not loaded:
        for path in config.warm_start_traces:
            warm_start(estimator, read_trace_jobs(path))
    if isinstance(estimator, Eq2Estimator):
        prefill_cost = _prefill_cost(environment)
        if prefill_cost is not None or config.prefill_profile == "none":
            estimator.prefill_cost = prefill_cost
    return estimator


def _prefill_cost(environment: PolicyEnvironment) -> PrefillCostModel | None:
    source = environment.estimator.prefill_profile
    if source == "none":
        return None
    if source != "auto":
        return PrefillCostModel.fit(read_prefill_profile(source))
    if environment.profile_prefill is None:
        return None
    points = environment.profile_prefill()
    if len({n for n, _ in points}) < 2:
        logger.warning("too few prefill lengths fit the KV pool to price rebuilds: R = 0")
        return None
    return PrefillCostModel.fit(points)


def save_estimator(estimator: TTLEstimator | None, environment: PolicyEnvironment) -> None:
    """Saves what the estimator learned to the configured state file, if both exist; an
    unwritable file is logged, not raised (the engine is stopping)."""
    path = environment.estimator.state_path
    if path is None or not isinstance(estimator, Eq2Estimator):
        return
    try:
        estimator.save(path)
    except OSError as error:
        logger.error("cannot save the estimator state to %s: %s", path, error)


def tool_name_of(request: Request, environment: PolicyEnvironment) -> str | None:
    """The tool a finished turn called: the client's word, else parsed from its output
    (None if neither says, or the output cannot be decoded)."""
    client_name = None if request.job is None else request.job.tool_name
    named = tool_key(None, client_tool_name=client_name)
    if named is not None or environment.decode is None:
        return named
    try:
        text = environment.decode(request.output_token_ids)
    except Exception as error:  # a step must not fail over one undecodable output
        logger.warning("cannot decode the output of %s to read its tool: %s",
                       request.request_id, error)
        return None
    return tool_key(text)


def ttl_inputs(call: ToolCall, estimator: TTLEstimator, ttl_s: float) -> TTLInputs:
    """What the estimator based the TTL it just gave for `call` on, for the trace."""
    decision = estimator.last_decision if isinstance(estimator, Eq2Estimator) else None
    if decision is None:
        source = getattr(estimator, "rule_name", type(estimator).__name__)
        return TTLInputs(ttl_s=finite_or_none(ttl_s), source=source, tool=call.tool_name)
    return TTLInputs(
        ttl_s=finite_or_none(ttl_s), source=decision.basis, tool=call.tool_name,
        num_samples=decision.num_samples, queueing_delay_s=decision.queueing_delay_s,
        eta=decision.eta, rebuild_s=decision.rebuild_s, benefit_s=decision.benefit_s,
    )
