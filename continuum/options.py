"""The options of the agent policies, each a frozen config parsed from `--policy-option`s.

Times are seconds on the scheduler's clock. The bounds (`max_job_age_s`, `max_wait_s`,
`pin_yield_wait_s`, `max_pinned_fraction`) are what keep every request's wait bounded; see
`docs/benchmarks.md` for how their defaults were chosen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from estimator.eq2 import COLD_START_SAMPLES, DEFAULT_MAX_TTL_S, PrefillFit, RebuildCost
from estimator.history import DEFAULT_MAX_SAMPLES
from estimator.registry import EstimatorName
from estimator.solver import PinCost

DEFAULT_JOB_IDLE_TIMEOUT_S = 600.0
# InferCept's expected tool duration before any is observed: the mean that Eq. 2's cold start
# assumes too (durations ~ Exp(mean 1 s)).
DEFAULT_TOOL_DURATION_S = 1.0


PinVictims = Literal["first", "last"]
PrefillVictims = Literal["none", "later-jobs"]
VictimOrder = Literal["latest-admitted", "latest-job"]
PrefillAdmission = Literal["first-chunk", "whole-prompt"]
PinYield = Literal["later-jobs", "overdue"]
PinExpiry = Literal["hard", "while-waiting"]
PinReleaseOrder = Literal["latest-job", "lowest-value"]
ReservablePins = Literal["later-jobs", "other-jobs"]
PinLoss = Literal["ignored", "discounted"]
ArrivalHold = Literal["none", "until-admitted"]


def _help(text: str) -> dict[str, str]:
    return {"help": text}


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class JobOptions:
    """What every job-aware policy takes."""

    job_idle_timeout_s: float = field(default=DEFAULT_JOB_IDLE_TIMEOUT_S, metadata=_help(
        "a job with no unfinished turn and no pin is forgotten after this long idle"))

    def __post_init__(self) -> None:
        _require(self.job_idle_timeout_s > 0,
                 f"job_idle_timeout_s must be > 0, got {self.job_idle_timeout_s!r}")


@dataclass(frozen=True)
class InferCeptOptions(JobOptions):
    """InferCept's handling of a turn paused on a tool: always preserve its KV (the default),
    or choose by its waste model between preserving, discarding and swapping it out."""

    swap: bool = field(default=False, metadata=_help(
        "on: for each turn that called a tool, preserve its KV (pinned until the next turn), "
        "discard it (recomputed) or swap it to the host tier (--kv-offload-gib; reloaded), "
        "whichever wastes the least memory-time; off: always preserve"))
    default_tool_duration_s: float = field(default=DEFAULT_TOOL_DURATION_S, metadata=_help(
        "with swap: a tool call's expected duration before any call was observed (then the "
        "mean of the tool's observed calls, else of all tools')"))

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(0 <= self.default_tool_duration_s < math.inf,
                 "default_tool_duration_s must be a finite number >= 0, got "
                 f"{self.default_tool_duration_s!r}")


@dataclass(frozen=True)
class ProgramOrderOptions(JobOptions):
    """Program-level order with its bounds: waiting turns sort by their job's first arrival,
    but never by a time more than `max_job_age_s` before their own arrival; a request that
    has waited `max_wait_s` heads the queue (in arrival order) whatever its job."""

    max_job_age_s: float = field(default=60.0, metadata=_help(
        "aging cap of program-level order: a turn sorts by its job's first arrival, but by no "
        "time older than this before its own arrival (inf: pure program order)"))
    max_wait_s: float = field(default=30.0, metadata=_help(
        "a request that has waited this long goes ahead of every tier, in arrival order "
        "(inf: never)"))
    max_plain_wait_s: float = field(default=10.0, metadata=_help(
        "a request without a job that has waited this long goes ahead of every tier but "
        "the max_wait_s one, in arrival order (inf: never); before that it already goes ahead "
        "of every job's turn that arrived after it"))
    prefill_victims: PrefillVictims = field(default="none", metadata=_help(
        "what a running request still prefilling may preempt: none (it waits while another "
        "decodes, else preempts itself) | later-jobs (like a decoding request: the latest "
        "job's request)"))
    victim_order: VictimOrder = field(default="latest-admitted", metadata=_help(
        "which running request is preempted first: latest-admitted (the most recently "
        "admitted: least computed since, so least recomputed) | latest-job (the request whose "
        "job arrived last)"))
    max_preemptions: int = field(default=3, metadata=_help(
        "a request preempted this many times is preempted again only when no other running "
        "request can be"))
    prefill_admission: PrefillAdmission = field(default="whole-prompt", metadata=_help(
        "when a waiting prompt may start: first-chunk (its first chunk's blocks are free or "
        "pinned, as vLLM) | whole-prompt (the blocks of all its chunks are free or in pins "
        "it may take, so that it need not stall or be preempted halfway)"))
    admission_headroom_blocks: int = field(default=1, metadata=_help(
        "with whole-prompt: blocks per running request that must be free or reservable beyond "
        "the prompt's before it starts, room for the running requests' next tokens (0: "
        "none)"))

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self.admission_headroom_blocks >= 0, "admission_headroom_blocks must be >= 0, "
                 f"got {self.admission_headroom_blocks!r}")
        _require(self.max_plain_wait_s >= 0,
                 f"max_plain_wait_s must be >= 0, got {self.max_plain_wait_s!r}")
        _require(self.max_preemptions >= 1,
                 f"max_preemptions must be >= 1, got {self.max_preemptions!r}")
        _require(self.max_job_age_s >= 0,
                 f"max_job_age_s must be >= 0, got {self.max_job_age_s!r}")
        _require(self.max_wait_s >= 0, f"max_wait_s must be >= 0, got {self.max_wait_s!r}")


@dataclass(frozen=True)
class ContinuumOptions(ProgramOrderOptions):
    """Continuum's pins and their estimator, on top of program-level order."""

    estimator: EstimatorName = field(default="eq2-empirical", metadata=_help(
        "the TTL rule: eq2-empirical (the paper's Eq. 2) | eq2-learned | fixed-2s"))
    rebuild_cost: RebuildCost = field(default="prefill-times-running", metadata=_help(
        "Eq. 2's R: prefill-times-running (the context's prefill time times 1 + the requests "
        "running beside the finished turn, whose steps a rebuild lengthens) | prefill (the "
        "paper: the prefill time alone)"))
    pin_cost: PinCost = field(default="priced-capped", metadata=_help(
        "what Eq. 2 charges a pin: ttl (the paper: its whole TTL) | expected-hold (the time it "
        "is expected to be held, since a used pin is released when the next turn arrives) | "
        "priced (that expected hold times the share of the pool it holds times the requests "
        "running and waiting) | priced-capped (priced, those requests counted up to the "
        "number the whole pool holds at the running requests' mean size)"))
    pin_loss: PinLoss = field(default="ignored", metadata=_help(
        "ignored | discounted (Eq. 2 counts that memory pressure may take a pin before the "
        "next turn comes, at the rate it took pins lately: pins taken per second held over "
        "the last 256 pins released; a pin then saves only if the turn comes first, and is "
        "charged until it goes)"))
    arrival_hold: ArrivalHold = field(default="none", metadata=_help(
        "none | until-admitted (a job's next turn that arrives while its job holds no pin "
        "has the prefix it finds cached held as its job's pin until it is admitted, at most "
        "max_wait_s or max_ttl_s, so that the prefix is not evicted while the turn waits, "
        "the turn then waiting in the pinned tier; such holds are the first pins a running "
        "request short of blocks or the pin cap takes; needs pin_expiry=hard)"))
    prefill_profile: str = field(default="auto", metadata=_help(
        "prices R: auto (prefills timed at start-up) | none (R = 0) | a JSON file of "
        "[num_tokens, seconds] points"))
    prefill_fit: PrefillFit = field(default="start-up", metadata=_help(
        "R's prefill time: start-up (the prefill_profile fit, prefills timed alone) | "
        "under-load (refitted on the last 256 prefills the engine ran, admission to first "
        "token, once 32 are seen; the start-up fit until then)"))
    cold_start_samples: int = field(default=0, metadata=_help(
        "Eq. 2 assumes tool durations ~ Exp(mean 1 s) and eta = 1 (the paper's cold start: "
        "ttl = ln(T + R)) until it has observed more than this many tool durations, "
        f"0 to {DEFAULT_MAX_SAMPLES - 1}: 0 (from the first observed duration on, the observed "
        f"ones decide) or {COLD_START_SAMPLES} (the paper's K), for example"))
    estimator_state: str | None = field(default=None, metadata=_help(
        "estimator state file: loaded at start if present and valid, saved at shutdown"))
    estimator_warm_start: tuple[str, ...] = field(default=(), metadata=_help(
        "comma-separated agent-job trace files the estimator learns from at start"))
    max_ttl_s: float = field(default=DEFAULT_MAX_TTL_S, metadata=_help(
        "no pin lasts longer than this"))
    pin_yield_wait_s: float = field(default=math.inf, metadata=_help(
        "pins give way (latest job first) to a waiting head that cannot get blocks once it has "
        "waited this long or max_wait_s, whichever is shorter, even while other requests run "
        "(0: at once, as in the paper); with nothing running they always do"))
    pin_victims: PinVictims = field(default="first", metadata=_help(
        "when a running request needs blocks: first (pins are released before any running "
        "request is preempted) | last (af226d3: only when the request would preempt itself)"))
    pin_release_order: PinReleaseOrder = field(default="latest-job", metadata=_help(
        "which pin a running request short of blocks takes first (after any arrival hold, "
        "before pins whose job's turn waits to reuse them and its own job's, which go "
        "last): latest-job (the pin of "
        "the job that arrived last) | lowest-value (the pin expected to save the least per "
        "block for each further second it is held, from its decision's benefit, TTL and "
        "tool-duration distribution at its age)"))
    pin_yield: PinYield = field(default="overdue", metadata=_help(
        "to a blocked waiting head: overdue (pins yield only once it has waited "
        "pin_yield_wait_s or max_wait_s, or max_plain_wait_s for a plain request) | "
        "later-jobs (the pins of jobs that arrived after its job yield at once too)"))
    pin_expiry: PinExpiry = field(default="hard", metadata=_help(
        "hard (a pin past its deadline is released at the end of the step, whoever waits) | "
        "while-waiting (af226d3: kept while a turn of its job waits)"))
    max_pinned_fraction: float = field(default=1.0, metadata=_help(
        "the share of the KV pool pins may hold; a new pin first releases later jobs' pins, "
        "else is declined (1: no cap beyond the rule that pins hold only memory no running "
        "request and no earlier job's waiting turn needs)"))
    reservable_pins: ReservablePins = field(default="later-jobs", metadata=_help(
        "whose pins a waiting prompt may count as room for its later chunks "
        "(prefill_admission=whole-prompt): later-jobs (pins of jobs that arrived after its "
        "own, other jobs' holds of waiting turns and pins whose job's turn waits behind it, "
        "or every other job's pin once it is overdue: a later job's prompt does not start "
        "on the memory pinned for an earlier job's next turn) | "
        "other-jobs (any other job's pin, the rule before)"))

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(bool(self.prefill_profile), "prefill_profile must be auto, none or a file")
        _require(self.prefill_fit == "start-up" or self.prefill_profile != "none",
                 "prefill_fit=under-load prices R, which prefill_profile=none sets to 0")
        _require(self.estimator_state != "", "estimator_state must be a file path")
        _require(0 <= self.cold_start_samples < DEFAULT_MAX_SAMPLES,
                 f"cold_start_samples must be in [0, {DEFAULT_MAX_SAMPLES}), got "
                 f"{self.cold_start_samples!r}")
        _require(self.max_ttl_s > 0 and math.isfinite(self.max_ttl_s),
                 f"max_ttl_s must be a positive finite number, got {self.max_ttl_s!r}")
        _require(self.pin_yield_wait_s >= 0,
                 f"pin_yield_wait_s must be >= 0, got {self.pin_yield_wait_s!r}")
        _require(0 < self.max_pinned_fraction <= 1,
                 f"max_pinned_fraction must be in (0, 1], got {self.max_pinned_fraction!r}")
        _require(self.arrival_hold == "none" or self.pin_expiry == "hard",
                 "arrival_hold needs pin_expiry=hard: a hold's turn is always waiting, so "
                 "while-waiting would keep it past its deadline")


@dataclass(frozen=True)
class ContinuumFixedOptions(ContinuumOptions):
    """Continuum with the preview release's 2 s rule as its estimator."""

    estimator: EstimatorName = field(default="fixed-2s", metadata=_help(
        "the TTL rule: fixed-2s (the release's rule) | eq2-empirical | eq2-learned"))


@dataclass(frozen=True)
class ContinuumAf226d3Options(ContinuumOptions):
    """The defaults of `continuum` as commit af226d3 ran it on the H100 (pins capped at 80 %
    of the pool); the bounds it did not have are off."""

    rebuild_cost: RebuildCost = field(default="prefill", metadata=_help(
        "Eq. 2's R: prefill (the paper, af226d3's default) | prefill-times-running"))
    cold_start_samples: int = field(default=COLD_START_SAMPLES, metadata=_help(
        "Eq. 2's cold-start prior holds until more than this many tool durations are "
        f"observed ({COLD_START_SAMPLES}: the paper's K, af226d3's rule)"))
    pin_cost: PinCost = field(default="ttl", metadata=_help(
        "what Eq. 2 charges a pin: ttl (the paper, af226d3's default) | expected-hold | "
        "priced | priced-capped"))
    max_pinned_fraction: float = field(default=0.8, metadata=_help(
        "the share of the KV pool pins may hold; a new pin first releases later jobs' pins, "
        "else is declined (1: no cap)"))
    victim_order: VictimOrder = field(default="latest-job", metadata=_help(
        "not used: the victim is the request whose job arrived last"))
    pin_victims: PinVictims = field(default="last", metadata=_help(
        "not used: pins are released only when the request would preempt itself"))
    pin_yield: PinYield = field(default="overdue", metadata=_help(
        "not used: pins yield to a blocked head only once it is overdue"))
    pin_expiry: PinExpiry = field(default="while-waiting", metadata=_help(
        "not used: a pin is kept past its deadline while a turn of its job waits"))
    max_plain_wait_s: float = field(default=math.inf, metadata=_help(
        "not used: requests without a job are ordered like turns"))
    max_preemptions: int = field(default=2**31 - 1, metadata=_help(
        "not used: victims are chosen without counting preemptions"))
    prefill_admission: PrefillAdmission = field(default="first-chunk", metadata=_help(
        "first-chunk (af226d3's rule: a prompt starts once its first chunk fits) | "
        "whole-prompt"))
    admission_headroom_blocks: int = field(default=0, metadata=_help(
        "not used: with first-chunk admission nothing is reserved"))
    reservable_pins: ReservablePins = field(default="other-jobs", metadata=_help(
        "not used: with first-chunk admission nothing is reserved"))
