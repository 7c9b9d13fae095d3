"""Tool-call latency estimation and TTL computation (never imports engine)."""

from estimator.base import ConstantTTLEstimator, ObservationSink, ToolCall, TTLEstimator
from estimator.cost_model import PrefillCostModel
from estimator.eq2 import Eq2Estimator, TTLDecision
from estimator.fixed import FixedTTLEstimator
from estimator.history import ToolDurationHistory
from estimator.parsing import ParsedToolCalls, parse_tool_calls, tool_key
from estimator.registry import ESTIMATORS, make_estimator
from estimator.solver import DurationCDF, cold_start_ttl, solve_ttl

__all__ = [
    "ESTIMATORS",
    "ConstantTTLEstimator",
    "DurationCDF",
    "Eq2Estimator",
    "FixedTTLEstimator",
    "ObservationSink",
    "ParsedToolCalls",
    "PrefillCostModel",
    "TTLDecision",
    "TTLEstimator",
    "ToolCall",
    "ToolDurationHistory",
    "cold_start_ttl",
    "make_estimator",
    "parse_tool_calls",
    "solve_ttl",
    "tool_key",
]
