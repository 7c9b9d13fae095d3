"""What a user sets on the agent policies (`--policy-option KEY=VALUE`), as frozen configs.

Times are seconds on the scheduler's clock. Every other choice of a policy is a strategy
object its preset composes (`continuum.presets`), and every other number a constant with
its decision record under `docs/decisions/`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.config import setting
from estimator.eq2 import DEFAULT_MAX_TTL_S
from estimator.estimator_registry import EstimatorName
from estimator.state_file import check_state_path

DEFAULT_JOB_IDLE_TIMEOUT_S = 600.0
# InferCept's expected tool duration before any is observed: the mean that Eq. 2's cold start
# assumes too (durations ~ Exp(mean 1 s)).
DEFAULT_TOOL_DURATION_S = 1.0
# Program-level order's aging and the lead of pinned turns (docs/decisions/
# 0004-waiting-bounds.md).
DEFAULT_SERVICE_WEIGHT = 2.0
DEFAULT_PIN_LEAD_S = 60.0


def option_setting(text: str) -> dict[str, object]:
    """The metadata of a policy option: the engine's `setting`, its help `text`; never a flag
    of its own (it is given as `--policy-option KEY=VALUE` or a `[policy_options]` key)."""
    return setting(text, group="policy", flag=False)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class JobOptions:
    """What every job-aware policy takes."""

    job_idle_timeout_s: float = field(default=DEFAULT_JOB_IDLE_TIMEOUT_S, metadata=option_setting(
        "seconds > 0: a job with no unfinished turn and no pin is forgotten after this long"))

    def __post_init__(self) -> None:
        _require(self.job_idle_timeout_s > 0,
                 f"job_idle_timeout_s must be > 0, got {self.job_idle_timeout_s!r}")


@dataclass(frozen=True)
class InferCeptOptions(JobOptions):
    """InferCept's handling of a turn paused on a tool: always preserve its KV (the default),
    or choose by its waste model between preserving, discarding and swapping it out."""

    swap: bool = field(default=False, metadata=option_setting(
        "on: for each turn that called a tool, preserve its KV (pinned until the next turn), "
        "discard it (recomputed) or swap it to the host tier (--kv-offload-gib; reloaded), "
        "whichever wastes the least memory-time; off: always preserve"))
    default_tool_duration_s: float = field(default=DEFAULT_TOOL_DURATION_S, metadata=option_setting(
        "seconds, >= 0, with swap: a tool call's expected duration before any call was "
        "observed (then the mean of the tool's observed calls, else of all tools')"))

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(0 <= self.default_tool_duration_s < math.inf,
                 "default_tool_duration_s must be a finite number >= 0, got "
                 f"{self.default_tool_duration_s!r}")


@dataclass(frozen=True)
class ProgramOrderOptions(JobOptions):
    """Program-level order aged by service (docs/decisions/0004-waiting-bounds.md): waiting
    turns sort by their job's first arrival moved later by `service_weight` times the engine
    seconds the job consumed; a request without a job that has waited `max_plain_wait_s`
    heads the queue."""

    service_weight: float = field(default=DEFAULT_SERVICE_WEIGHT, metadata=option_setting(
        "finite >= 0 (0: pure program order): a job's turns sort as if it arrived this many "
        "seconds later per second of engine time its turns took"))
    pin_lead_s: float = field(default=DEFAULT_PIN_LEAD_S, metadata=option_setting(
        "seconds >= 0 (inf: ahead of all): a turn whose job holds a live pin sorts as if its "
        "job arrived this much earlier"))
    max_plain_wait_s: float = field(default=10.0, metadata=option_setting(
        "seconds >= 0 (inf: never): a request without a job that waited this long goes "
        "first, and pins yield to it"))

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(0 <= self.service_weight < math.inf,
                 f"service_weight must be a finite number >= 0, got {self.service_weight!r}")
        for name in ("pin_lead_s", "max_plain_wait_s"):
            value = getattr(self, name)
            _require(value >= 0, f"{name} must be >= 0, got {value!r}")


@dataclass(frozen=True)
class ContinuumOptions(ProgramOrderOptions):
    """Continuum's pins and their estimator, on top of program-level order."""

    estimator: EstimatorName = field(default="eq2-empirical", metadata=option_setting(
        "the TTL rule: eq2-empirical (the paper's Eq. 2) | eq2-learned | fixed-2s (the "
        "release's 2 s rule)"))
    estimator_state: str | None = field(default=None, metadata=option_setting(
        "JSON file of the estimator's state: loaded at start, saved at shutdown"))
    max_ttl_s: float = field(default=DEFAULT_MAX_TTL_S, metadata=option_setting(
        "seconds > 0, finite: no pin lasts longer"))
    max_pinned_fraction: float = field(default=1.0, metadata=option_setting(
        "in (0, 1]: the share of the KV pool pins may hold (1: no cap)"))

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self.estimator_state != "", "estimator_state must be a file path")
        if self.estimator_state is not None:
            check_state_path(self.estimator_state)
        _require(self.max_ttl_s > 0 and math.isfinite(self.max_ttl_s),
                 f"max_ttl_s must be a positive finite number, got {self.max_ttl_s!r}")
        _require(0 < self.max_pinned_fraction <= 1,
                 f"max_pinned_fraction must be in (0, 1], got {self.max_pinned_fraction!r}")


@dataclass(frozen=True)
class ContinuumFixedOptions(ContinuumOptions):
    """Continuum with the preview release's 2 s rule as its estimator."""

    estimator: EstimatorName = field(default="fixed-2s", metadata=option_setting(
        "the TTL rule: fixed-2s (the release's rule) | eq2-empirical | eq2-learned"))
