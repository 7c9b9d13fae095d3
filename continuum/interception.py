"""InferCept's waste model: what to do with the KV of a turn paused on a tool call.

Each choice is charged the GPU memory-time it wastes, in block-seconds:

- preserve (pin until the next turn): the context's blocks sit unused for the tool's
  expected duration, `context_blocks * expected_tool_s`;
- discard (free without storing; the next turn recomputes the context): while it is
  recomputed, the context's blocks and those of the running requests, whose steps carry the
  recompute, hold memory that produces no new tokens: `recompute_s * (context_blocks +
  running_blocks)`;
- swap (free with a store to the host tier; the next turn loads it back): the store overlaps
  the forward, so only the load, which runs before the next turn's forward, stalls the same
  memory: `reload_s * (context_blocks + running_blocks)`.

The least waste wins; ties go to preserve, then swap, then discard. A choice that cannot be
priced is not taken: discard without a prefill profile, swap without a host tier, without a
load profile, or for a context larger than the tier. The expected duration is the running
mean of the tool's observed durations (a turn's finish to its job's next arrival), else of
all tools', else a configured default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from estimator.cost_model import HostReloadCost, PrefillCostModel
from estimator.history import ToolDurationHistory
from estimator.ttl_estimator import ToolCall

InterceptionChoice = Literal["preserve", "discard", "swap"]


@dataclass(frozen=True, slots=True)
class InterceptionWaste:
    """Block-seconds each choice would waste for one paused turn; None for a choice that
    cannot be taken or priced."""

    preserve_block_s: float
    discard_block_s: float | None
    swap_block_s: float | None

    @property
    def choice(self) -> InterceptionChoice:
        """The least wasteful choice (ties: preserve, then swap, then discard)."""
        candidates: list[tuple[float, int, InterceptionChoice]] = [
            (self.preserve_block_s, 0, "preserve")]
        if self.swap_block_s is not None:
            candidates.append((self.swap_block_s, 1, "swap"))
        if self.discard_block_s is not None:
            candidates.append((self.discard_block_s, 2, "discard"))
        return min(candidates)[2]


@dataclass(frozen=True, slots=True)
class InterceptionDecision:
    """The choice for one paused turn and what it was computed from. Seconds: the tool's
    `expected_tool_s` (from `num_samples` observed durations; 0: the default), and the
    context's `recompute_s` and `reload_s` (None where not priced)."""

    choice: InterceptionChoice
    waste: InterceptionWaste
    expected_tool_s: float
    num_samples: int
    recompute_s: float | None
    reload_s: float | None

    @property
    def rebuild_s(self) -> float | None:
        """Seconds to bring the context back without preserving it: by the choice taken, or
        for a preserved one by the cheaper alternative (None if neither is priced)."""
        if self.choice == "discard":
            return self.recompute_s
        if self.choice == "swap":
            return self.reload_s
        priced = [s for s in (self.recompute_s, self.reload_s) if s is not None]
        return min(priced, default=None)


class InterceptionModel:
    """Owned by one InferCept policy (single-threaded): learns tool durations from job
    timing and picks the least wasteful choice for each paused turn (see the module
    docstring). `recompute_cost` prices recomputing a context (None: discard is never
    chosen), `reload_cost` loading it from the host tier (None: no tier, swap is never
    chosen); `default_tool_duration_s` is the expected duration before any is observed."""

    def __init__(self, *, recompute_cost: PrefillCostModel | None,
                 reload_cost: HostReloadCost | None, default_tool_duration_s: float,
                 history: ToolDurationHistory | None = None) -> None:
        if not 0 <= default_tool_duration_s < math.inf:
            raise ValueError("default_tool_duration_s must be a finite number >= 0, got "
                             f"{default_tool_duration_s!r}")
        self.recompute_cost = recompute_cost
        self.reload_cost = reload_cost
        self.default_tool_duration_s = default_tool_duration_s
        self.history = ToolDurationHistory() if history is None else history

    # Observations.
    def observe_tool_call(self, call: ToolCall) -> None:
        """The call's tool started when its turn finished."""
        self.history.start(call)

    def observe_next_turn(self, job_id: str, arrived_at_s: float) -> None:
        """The job's next turn arrived: its pending call's duration is recorded."""
        self.history.finish(job_id, arrived_at_s)

    def forget_job(self, job_id: str) -> None:
        self.history.forget_job(job_id)

    # The choice.
    def expected_tool_s(self, tool_name: str | None) -> tuple[float, int]:
        """(the expected duration of a call of the tool, the samples behind it): the mean
        of the tool's observed durations, else of all tools', else the default (0 samples)."""
        keys = (None,) if tool_name is None else (tool_name, None)
        for key in keys:
            samples = self.history.samples(key)
            if samples:
                return math.fsum(samples) / len(samples), len(samples)
        return self.default_tool_duration_s, 0

    def decide(self, call: ToolCall, *, block_size: int,
               num_running_blocks: int) -> InterceptionDecision:
        """The least wasteful choice for the paused turn `call`, with `num_running_blocks`
        blocks held by the requests running beside it."""
        num_context_blocks = -(-call.num_context_tokens // block_size)
        num_stalled_blocks = num_context_blocks + num_running_blocks
        expected_s, num_samples = self.expected_tool_s(call.tool_name)
        recompute_s = (None if self.recompute_cost is None
                       else self.recompute_cost.cost_s(call.num_context_tokens))
        reload_s = (None if self.reload_cost is None
                    else self.reload_cost.cost_s(call.num_context_tokens))
        waste = InterceptionWaste(
            preserve_block_s=num_context_blocks * expected_s,
            discard_block_s=None if recompute_s is None else recompute_s * num_stalled_blocks,
            swap_block_s=None if reload_s is None else reload_s * num_stalled_blocks,
        )
        return InterceptionDecision(waste.choice, waste, expected_s, num_samples, recompute_s,
                                    reload_s)
