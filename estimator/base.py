"""The interface between scheduling policies and tool-call latency estimators.

A policy reports what it observes (a turn finished with a tool call, the job's next turn
arrived, a turn waited after its KV was dropped, a job ended) and asks for a TTL when it
decides whether to pin a finished turn. Times are seconds on the caller's clock. This
package never imports `engine`: the policy translates its requests into `ToolCall`s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A finished, non-final turn of a job, whose tool now runs.

    `tool_name` is the tool the turn called when known (None: unknown, pooled statistics
    apply); `num_context_tokens` is the turn's prompt plus output, the context the next turn
    extends; `turn_index` counts the job's earlier turns (0 for its first);
    `num_running_requests` counts the other requests running when it finished, whose steps a
    rebuild of the context would share (and lengthen).
    """

    job_id: str
    tool_name: str | None
    finished_at_s: float
    num_context_tokens: int
    turn_index: int
    num_running_requests: int = 0


class TTLEstimator(Protocol):
    """Decides how long a finished turn's KV stays pinned, and learns from observations.

    Owned by one scheduling policy and called only from its thread, in this order for a job:
    `observe_tool_call` and `ttl_s` when a turn finishes, `observe_next_turn` when the
    next turn arrives, `observe_queueing_delay` when a turn that found no pin is admitted,
    and `observe_job_end` once when the job ends.
    """

    def ttl_s(self, call: ToolCall) -> float:
        """Seconds to pin the turn's KV; 0 means do not pin."""
        ...

    def observe_tool_call(self, call: ToolCall) -> None: ...

    def observe_next_turn(self, job_id: str, arrived_at_s: float) -> None: ...

    def observe_queueing_delay(self, delay_s: float) -> None: ...

    def observe_job_end(self, job_id: str, num_turns: int) -> None: ...


class ObservationSink:
    """Ignores every observation: the base of estimators that learn nothing."""

    def observe_tool_call(self, call: ToolCall) -> None:
        pass

    def observe_next_turn(self, job_id: str, arrived_at_s: float) -> None:
        pass

    def observe_queueing_delay(self, delay_s: float) -> None:
        pass

    def observe_job_end(self, job_id: str, num_turns: int) -> None:
        pass


class ConstantTTLEstimator(ObservationSink):
    """The same TTL for every tool call (0 disables pinning)."""

    rule_name = "constant"

    def __init__(self, ttl_s: float = 2.0) -> None:
        if not ttl_s >= 0 or ttl_s == float("inf"):
            raise ValueError(f"ttl_s must be a finite number >= 0, got {ttl_s!r}")
        self._ttl_s = float(ttl_s)

    def ttl_s(self, call: ToolCall) -> float:
        return self._ttl_s
