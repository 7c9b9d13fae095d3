"""Tool-call latency estimation and TTL computation (never imports engine)."""

from estimator.base import ConstantTTLEstimator, ObservationSink, ToolCall, TTLEstimator
from estimator.fixed import FixedTTLEstimator
from estimator.history import ToolDurationHistory

__all__ = [
    "ConstantTTLEstimator",
    "FixedTTLEstimator",
    "ObservationSink",
    "TTLEstimator",
    "ToolCall",
    "ToolDurationHistory",
]
