"""Tool durations observed from job timing, per tool and pooled, bounded in memory.

A tool's duration is the time from a turn's finish to the arrival of its job's next turn,
clamped into [0, `MAX_OBSERVED_S`] seconds (a NaN one is not recorded).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence

from estimator.ttl_estimator import ToolCall, clamp_seconds

# The latest durations kept per tool and pooled, by default.
DEFAULT_MAX_SAMPLES = 1000


class ToolDurationHistory:
    """The latest `max_samples` durations of each tool and of all tools together.

    At most `max_tools` tools are remembered (the least recently sampled is forgotten) and at
    most `max_pending` tool calls await their next turn (the oldest is dropped), so memory is
    bounded however many jobs and tool names pass through.
    """

    def __init__(
        self, *, max_samples: int = DEFAULT_MAX_SAMPLES, max_tools: int = 256,
        max_pending: int = 100_000,
    ) -> None:
        for name, value in (("max_samples", max_samples), ("max_tools", max_tools),
                            ("max_pending", max_pending)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.max_samples = max_samples
        self.max_tools = max_tools
        self.max_pending = max_pending
        self._by_tool: OrderedDict[str, deque[float]] = OrderedDict()
        self._pooled: deque[float] = deque(maxlen=max_samples)
        self._pending: OrderedDict[str, ToolCall] = OrderedDict()

    def start(self, call: ToolCall) -> None:
        """The call's tool started when its turn finished; a pending call of the job is
        replaced (its next turn never came)."""
        self._pending.pop(call.job_id, None)
        self._pending[call.job_id] = call
        if len(self._pending) > self.max_pending:
            self._pending.popitem(last=False)

    def finish(self, job_id: str, arrived_at_s: float) -> float | None:
        """The job's next turn arrived: records and returns its pending call's duration."""
        finished = self.finish_call(job_id, arrived_at_s)
        return None if finished is None else finished[1]

    def finish_call(self, job_id: str, arrived_at_s: float) -> tuple[ToolCall, float] | None:
        """As `finish`, returning the call with its duration (None if none was pending, or
        if the duration is NaN)."""
        call = self._pending.pop(job_id, None)
        if call is None:
            return None
        duration_s = clamp_seconds(arrived_at_s - call.finished_at_s)
        if duration_s is None:
            return None
        self.add(call.tool_name, duration_s)
        return call, duration_s

    def forget_job(self, job_id: str) -> None:
        self._pending.pop(job_id, None)

    def add(self, tool_name: str | None, duration_s: float) -> None:
        """Records a duration (clamped; NaN ignored); a sample without a tool name counts only
        in the pool."""
        clamped = clamp_seconds(duration_s)
        if clamped is None:
            return
        self._pooled.append(clamped)
        if tool_name is not None:
            self._add_to_tool(tool_name, clamped)

    def add_to_tool(self, tool_name: str, duration_s: float) -> None:
        """Records a duration (clamped; NaN ignored) for the tool only (restoring saved
        per-tool samples)."""
        clamped = clamp_seconds(duration_s)
        if clamped is not None:
            self._add_to_tool(tool_name, clamped)

    def _add_to_tool(self, tool_name: str, duration_s: float) -> None:
        samples = self._by_tool.pop(tool_name, None)
        if samples is None:
            samples = deque(maxlen=self.max_samples)
        samples.append(duration_s)
        self._by_tool[tool_name] = samples
        if len(self._by_tool) > self.max_tools:
            self._by_tool.popitem(last=False)

    def extend_pooled(self, durations_s: Sequence[float]) -> None:
        """Records durations (clamped; NaN ignored) in the pool only (restoring saved pooled
        samples)."""
        for duration_s in durations_s:
            clamped = clamp_seconds(duration_s)
            if clamped is not None:
                self._pooled.append(clamped)

    @property
    def tool_names(self) -> list[str]:
        """Tools with samples, least recently sampled first."""
        return list(self._by_tool)

    def samples(self, tool_name: str | None) -> Sequence[float]:
        """The tool's recorded durations (oldest first); the pool's for `None`."""
        if tool_name is None:
            return self._pooled
        return self._by_tool.get(tool_name, ())

    def mean_s(self, tool_name: str | None) -> float | None:
        """The mean of the tool's recorded durations (the pool's for `None`); None if none."""
        samples = self.samples(tool_name)
        return math.fsum(samples) / len(samples) if samples else None

    @property
    def num_pending(self) -> int:
        return len(self._pending)
