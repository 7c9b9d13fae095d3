"""The Continuum preview release's TTL rule, kept as a baseline."""

from __future__ import annotations

import math
from collections.abc import Iterable

from estimator.history import ToolDurationHistory
from estimator.traces import TraceJob
from estimator.ttl_estimator import ObservationSink, ToolCall, TTLDecision


class FixedTTLEstimator(ObservationSink):
    """Pins for exactly `ttl_s` (2.0 s) when the tool's mean observed duration is at most
    `ttl_s` or unknown (no samples yet, or no tool name), else not at all."""

    def __init__(self, ttl_s: float = 2.0, history: ToolDurationHistory | None = None) -> None:
        if not (ttl_s > 0 and math.isfinite(ttl_s)):
            raise ValueError(f"ttl_s must be a positive finite number, got {ttl_s!r}")
        self._ttl_s = float(ttl_s)
        self.history = ToolDurationHistory() if history is None else history

    def decide(self, call: ToolCall) -> TTLDecision:
        mean_s = None if call.tool_name is None else self.history.mean_s(call.tool_name)
        ttl_s = self._ttl_s if mean_s is None or mean_s <= self._ttl_s else 0.0
        num_samples = 0 if call.tool_name is None else len(self.history.samples(call.tool_name))
        return TTLDecision(ttl_s, "fixed", num_samples=num_samples)

    def observe_tool_call(self, call: ToolCall) -> None:
        self.history.start(call)

    def observe_next_turn(self, job_id: str, arrived_at_s: float) -> None:
        self.history.finish(job_id, arrived_at_s)

    def observe_job_end(self, job_id: str, num_turns: int) -> None:
        self.history.forget_job(job_id)

    def warm_start(self, jobs: Iterable[TraceJob]) -> None:
        """Learns the traces' tool durations."""
        for job in jobs:
            for call in job.calls:
                self.history.add(call.tool_name, call.duration_s)
