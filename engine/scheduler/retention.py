"""A policy's decision on a finished turn of a job (`Retention`) and why (`RetentionInputs`).

Returned by `SchedulingPolicy.retention`, carried out by the scheduler, and explained in its
event stream (`events.RetentionDecided`), which the tracer writes as the trace's `TTLInputs`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The `RetentionInputs.source` of a turn the policy failed to decide on (its output broke a
# parser, say): the scheduler frees its blocks and goes on.
POLICY_ERROR = "policy-error"


@dataclass(frozen=True, slots=True)
class RetentionInputs:
    """Why a policy chose a TTL (`ttl_s`, before anything overruled it; 0: do not pin) for a
    finished turn that called `tool`, or for the cached prefix of a turn that arrived, for
    whoever records it (the trace).

    `source` names the rule: for Eq. 2 the distribution that decided (`cold-start`, `tool`,
    `pooled`, `learned`), else the policy's rule (`fixed`, `constant`, `until-next-turn`,
    `no-tool-call`; InferCept with swap: `preserve`, `discard` or `swap`; `policy-error`
    when the policy raised and the scheduler decided for it). Eq. 2's inputs,
    when it decided: `num_samples` of the distribution, `queueing_delay_s` (T), `eta`,
    `rebuild_s` (R), `benefit_s` (T * eta + R) and `memory_price` (seconds of the others'
    delay a second of the pin costs, with a priced `pin_cost`). `declined_by` names what
    overruled a positive TTL (`pin-cap`: the pins' share of the pool was full)."""

    ttl_s: float | None
    source: str
    tool: str | None = None
    num_samples: int | None = None
    queueing_delay_s: float | None = None
    eta: float | None = None
    rebuild_s: float | None = None
    benefit_s: float | None = None
    declined_by: str | None = None
    memory_price: float | None = None


@dataclass(frozen=True, slots=True)
class Retention:
    """A policy's decision on a finished turn of a job: pin its cached blocks for `ttl_s`
    seconds (> 0; `math.inf` holds them until released), or not at all (0). `inputs` say
    why, for the scheduler's event stream (a pin is then traced as pinned or declined).
    `offload`: when not pinned, whether the blocks freed go to the host tier (if the engine
    has one) or are left to be recomputed. `release_job_ids`: the jobs whose pins the
    scheduler releases (PRESSURE) before pinning, to make room for the new pin."""

    ttl_s: float
    inputs: RetentionInputs
    offload: bool = True
    release_job_ids: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if math.isnan(self.ttl_s) or self.ttl_s < 0:
            raise ValueError(f"a retention ttl_s must be >= 0, got {self.ttl_s!r}")

    @property
    def pins(self) -> bool:
        return self.ttl_s > 0
