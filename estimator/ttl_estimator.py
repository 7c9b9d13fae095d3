"""The interface between scheduling policies and tool-call latency estimators.

A policy reports what it observes (a turn finished with a tool call, the job's next turn
arrived, a turn waited after its KV was dropped, a job ended) and asks for a decision when it
decides whether to pin a finished turn. Times are seconds on the caller's clock. This
package never imports `engine`: the policy translates its requests into `ToolCall`s.

No observation may make an estimator raise or overflow, however large: what estimators take
in is clamped to the bounds below (a duration or delay beyond `MAX_OBSERVED_S` counts as
`MAX_OBSERVED_S`), and a saved state holding values beyond them is refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from estimator.traces import TraceJob

# The longest tool duration or queueing delay an estimator records, in seconds (one day).
MAX_OBSERVED_S = 86_400.0
# The longest context, in tokens, that features and rebuild costs are computed for.
MAX_CONTEXT_TOKENS = 1 << 32
# The most turns a job, and the most requests running beside a turn, that are counted.
MAX_JOB_TURNS = 1_000_000
MAX_RUNNING_REQUESTS = 1_000_000


def clamp_seconds(value: float) -> float | None:
    """An observed duration or delay clamped into [0, `MAX_OBSERVED_S`] seconds; None for
    NaN, which says nothing."""
    if isinstance(value, float) and math.isnan(value):
        return None
    return float(min(max(value, 0.0), MAX_OBSERVED_S))


def clamp_count(value: int, maximum: int) -> int:
    """A count clamped into [0, `maximum`] (0 for NaN)."""
    return int(min(value, maximum)) if value > 0 else 0


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A finished, non-final turn of a job, whose tool now runs.

    `tool_name` is the tool the turn called when known (None: unknown, pooled statistics
    apply); `num_context_tokens` is the turn's prompt plus output, the context the next turn
    extends; `turn_index` counts the job's earlier turns (0 for its first);
    `num_running_requests` counts the other requests running when it finished, whose steps a
    rebuild of the context would share; `num_waiting_requests` the requests waiting then;
    `pool_share` the share of the KV pool the context's blocks take (0 when unknown);
    `running_pool_share` the other running requests' computed tokens over the pool's tokens
    (a prefix they share counts once for each; 0 when unknown);
    `request_id` names the finished turn (None when the caller has no such name, as in trace
    replays).
    """

    job_id: str
    tool_name: str | None
    finished_at_s: float
    num_context_tokens: int
    turn_index: int
    num_running_requests: int = 0
    request_id: str | None = None
    num_waiting_requests: int = 0
    pool_share: float = 0.0
    running_pool_share: float = 0.0


@dataclass(frozen=True, slots=True)
class TTLDecision:
    """A TTL and what it was based on, returned by `TTLEstimator.decide`. Seconds throughout.

    `basis` names the rule or distribution that decided ("cold-start", "tool", "pooled",
    "learned", "fixed", "constant", "oracle", ...); the other inputs are None where the
    estimator does not use them: `num_samples` (durations behind the distribution),
    `queueing_delay_s` (T), `eta`, `rebuild_s` (R), `benefit_s` (T * eta + R) and
    `memory_price` (seconds of the others' delay a second of the pin costs, with a priced
    `pin_cost`). `ttl_s` is finite and >= 0; 0 means do not pin.
    """

    ttl_s: float
    basis: str
    num_samples: int | None = None
    queueing_delay_s: float | None = None
    eta: float | None = None
    rebuild_s: float | None = None
    benefit_s: float | None = None
    memory_price: float | None = None

    def __post_init__(self) -> None:
        if not (self.ttl_s >= 0 and math.isfinite(self.ttl_s)):
            raise ValueError(f"ttl_s must be finite and >= 0, got {self.ttl_s!r}")


class TTLEstimator(Protocol):
    """Decides how long a finished turn's KV stays pinned, and learns from observations.

    Owned by one scheduling policy and called only from its thread, in this order for a job:
    `observe_tool_call` and `decide` when a turn finishes, `observe_next_turn` when the next
    turn arrives, `observe_queueing_delay` when a turn that found no pin is admitted, and
    `observe_job_end` once when the job ends. `warm_start` and `load_state` come before any
    of these; `state` at any time (the policy saves it at shutdown).
    """

    def decide(self, call: ToolCall) -> TTLDecision:
        """The TTL for the call's KV, with its inputs."""
        ...

    def observe_tool_call(self, call: ToolCall) -> None:
        """The call's turn finished and its tool started (at `call.finished_at_s`)."""
        ...

    def observe_next_turn(self, job_id: str, arrived_at_s: float) -> None:
        """The job's next turn arrived at `arrived_at_s`: its pending call's duration is
        known."""
        ...

    def observe_queueing_delay(self, delay_s: float) -> None:
        """A turn that came back without its KV (its pin had expired, or there was none)
        waited `delay_s` seconds from arrival to admission: the `T` of Eq. 2."""
        ...

    def observe_job_end(self, job_id: str, num_turns: int) -> None:
        """The job ended after `num_turns` turns."""
        ...

    def warm_start(self, jobs: Iterable[TraceJob]) -> None:
        """Learns from agent-job traces as if their jobs had run here (if it learns)."""
        ...

    def state(self) -> dict[str, Any] | None:
        """What was learned, as JSON-ready data; None if the estimator keeps nothing."""
        ...

    def load_state(self, state: object) -> None:
        """Replaces what was learned with an earlier `state()`; ValueError, and no change,
        if it is not one."""
        ...


class ObservationSink:
    """Ignores every observation and keeps no state: the base of estimators that learn
    nothing."""

    def observe_tool_call(self, call: ToolCall) -> None:
        pass

    def observe_next_turn(self, job_id: str, arrived_at_s: float) -> None:
        pass

    def observe_queueing_delay(self, delay_s: float) -> None:
        pass

    def observe_job_end(self, job_id: str, num_turns: int) -> None:
        pass

    def warm_start(self, jobs: Iterable[TraceJob]) -> None:
        pass

    def state(self) -> dict[str, Any] | None:
        return None

    def load_state(self, state: object) -> None:
        raise ValueError(f"{type(self).__name__} keeps no state to load")


class ConstantTTLEstimator(ObservationSink):
    """The same TTL for every tool call (0 disables pinning)."""

    def __init__(self, ttl_s: float = 2.0) -> None:
        if not ttl_s >= 0 or ttl_s == float("inf"):
            raise ValueError(f"ttl_s must be a finite number >= 0, got {ttl_s!r}")
        self._ttl_s = float(ttl_s)

    def decide(self, call: ToolCall) -> TTLDecision:
        return TTLDecision(self._ttl_s, "constant")
