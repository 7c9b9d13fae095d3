"""Tool-call latency estimation and TTL computation (never imports engine)."""

from estimator.cost_model import HostReloadCost, PrefillCostModel
from estimator.eq2 import DEFAULT_MAX_TTL_S, Eq2Estimator, RebuildCost
from estimator.estimator_registry import ESTIMATORS, EstimatorSettings, make_estimator
from estimator.fixed import FixedTTLEstimator
from estimator.history import ToolDurationHistory
from estimator.parsing import ParsedToolCalls, parse_tool_calls, tool_key
from estimator.solver import DurationCDF, cold_start_ttl, solve_ttl
from estimator.state_file import load_state_or_cold_start, read_state, save_state
from estimator.ttl_estimator import (
    MAX_OBSERVED_S,
    ConstantTTLEstimator,
    ObservationSink,
    ToolCall,
    TTLDecision,
    TTLEstimator,
)

__all__ = [
    "DEFAULT_MAX_TTL_S",
    "ESTIMATORS",
    "MAX_OBSERVED_S",
    "ConstantTTLEstimator",
    "DurationCDF",
    "Eq2Estimator",
    "EstimatorSettings",
    "FixedTTLEstimator",
    "HostReloadCost",
    "ObservationSink",
    "ParsedToolCalls",
    "PrefillCostModel",
    "RebuildCost",
    "TTLDecision",
    "TTLEstimator",
    "ToolCall",
    "ToolDurationHistory",
    "cold_start_ttl",
    "load_state_or_cold_start",
    "make_estimator",
    "parse_tool_calls",
    "read_state",
    "save_state",
    "solve_ttl",
    "tool_key",
]
