"""The Continuum estimator: Eq. 2 of the paper over observed (or predicted) tool durations.

For a finished turn that called tool `f` with a context of `r` tokens:
`ttl = argmax over t in {0} and samples(f) of P(t) * (T * eta + R(r)) - t`, where `P` is the
empirical CDF of `f`'s durations, `T` the recent mean queueing delay of turns that came back
without their KV, `eta` the anti-correlation of jobs' done and remaining turns, and `R` the
cost of rebuilding `r` tokens. With at most `cold_start_samples` samples overall (the paper's
K = 100; 0 by default: the first observed duration ends it, since with the paper's K the
prior decides every pin of a short run on a fresh engine, docs/decisions/0003-cold-start.md),
durations are assumed Exp(mean 1 s) and eta = 1, giving `ttl = ln(T + R)` when `T + R > 1`;
beyond that, the empirical CDF of `f`'s durations once `f` has more than `min_tool_samples`
(the paper's K), else the pooled CDF of all tools. With a fitted
`predictor`, the CDF is instead the predictor's conditional distribution for the call.

`R` is the paper's with `rebuild_cost="prefill"`: the prefill time of `r` tokens (the fit of
the prefills the engine timed at start-up, or a profile), or, when the engine has a host KV
tier that can hold `r` tokens (`reload_cost`), the time to load them back from it (a pin that
expires or is released leaves its blocks there). `rebuild_cost="prefill-times-running"` (the
default, as `continuum` runs) multiplies it by 1 + the other requests running when the turn
finished (`ToolCall.num_running_requests`), since in an engine that batches prefill and decode
tokens into one step a rebuild lengthens their steps too (docs/decisions/0002-rebuild-cost.md).
A pin is charged its TTL, as in the paper (`pin_cost="ttl"`), or the time it is expected to
be held (`pin_cost="expected-hold"`, see `estimator.solver`), or that expected hold priced by
the memory it takes from the requests running and waiting (`pin_cost="priced"`), those
requests counted up to as many as the pool holds at the running ones' mean size
(`pin_cost="priced-capped"`, the default, free while no request waits:
docs/decisions/0001-memory-priced-pins.md); the
cold start is the paper's whichever. The defaults are those `continuum` runs, stated once
here (`DEFAULT_*`); the paper's (`prefill`, `ttl`, K = 100) run in `eval/policy_variants.py`.
Every TTL is capped at `max_ttl_s`.

Nothing observed can make a decision raise or pin forever: durations and delays are clamped
to `MAX_OBSERVED_S` and counts to their bounds (`estimator.ttl_estimator`), and a saved state is
loaded only if every sum, mean and cost it implies is finite and plausible.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from collections.abc import Iterable
from typing import Any, Literal

from estimator.cost_model import (
    PLAUSIBILITY_CONTEXT_TOKENS,
    HostReloadCost,
    PrefillCostModel,
)
from estimator.history import ToolDurationHistory
from estimator.predictor import (
    CallFeatures,
    DurationPredictor,
    DurationRecord,
    RecentCalls,
    bounded_duration_s,
)
from estimator.signals import RemainingTurnsCorrelation, SlidingMean
from estimator.solver import (
    PIN_COSTS,
    PRICED_PIN_COSTS,
    DurationCDF,
    PinCost,
    cold_start_ttl,
    memory_price,
    pool_capacity_requests,
    solve_ttl,
)
from estimator.traces import TraceJob
from estimator.ttl_estimator import (
    MAX_JOB_TURNS,
    MAX_RUNNING_REQUESTS,
    ToolCall,
    TTLDecision,
    clamp_count,
    clamp_seconds,
)

logger = logging.getLogger(__name__)

COLD_START_SAMPLES = 100  # the paper's K: its cold start, and a tool's own CDF after it
STATE_VERSION = 1
DEFAULT_MAX_TTL_S = 600.0

RebuildCost = Literal["prefill", "prefill-times-running"]
REBUILD_COSTS: tuple[RebuildCost, ...] = ("prefill", "prefill-times-running")
# The decided defaults (docs/decisions/0001-0003), which `continuum` runs.
DEFAULT_REBUILD_COST: RebuildCost = "prefill-times-running"
DEFAULT_PIN_COST: PinCost = "priced-capped"
DEFAULT_COLD_START_SAMPLES = 0


class Eq2Estimator:
    """Owned by one policy (single-threaded); see the module docstring for the rule.

    `prefill_cost` prices `R` (None: R = 0), as `rebuild_cost` says, except for contexts the
    host tier holds, which `reload_cost` prices (None: no tier); `pin_cost` says what a
    pin is charged (see the module docstring); the cold start holds while at most
    `cold_start_samples` durations are observed, and a tool's own CDF decides once it has more
    than `min_tool_samples`; `max_ttl_s` caps every TTL; `predictor`, once
    fitted, replaces the empirical CDF; `max_records` bounds the finished calls kept to
    (re)train it. With `refit_every`, a copy of the predictor is retrained on the records
    after that many new ones, in a background thread (`refit_in_background`) so that no
    scheduler step waits for it, and swapped in when done.
    """

    def __init__(
        self,
        *,
        prefill_cost: PrefillCostModel | None = None,
        reload_cost: HostReloadCost | None = None,
        rebuild_cost: RebuildCost = DEFAULT_REBUILD_COST,
        pin_cost: PinCost = DEFAULT_PIN_COST,
        max_ttl_s: float = DEFAULT_MAX_TTL_S,
        predictor: DurationPredictor | None = None,
        cold_start_samples: int = DEFAULT_COLD_START_SAMPLES,
        min_tool_samples: int = COLD_START_SAMPLES,
        history: ToolDurationHistory | None = None,
        queueing_window: int = 256,
        max_records: int = 20_000,
        refit_every: int | None = None,
        refit_in_background: bool = True,
    ) -> None:
        self.history = ToolDurationHistory() if history is None else history
        for name, value in (("cold_start_samples", cold_start_samples),
                            ("min_tool_samples", min_tool_samples)):
            if not 0 <= value < self.history.max_samples:
                raise ValueError(f"{name} must be in [0, {self.history.max_samples}), "
                                 f"got {value}")
        if rebuild_cost not in REBUILD_COSTS:
            raise ValueError(f"rebuild_cost must be one of {REBUILD_COSTS}, got {rebuild_cost!r}")
        if pin_cost not in PIN_COSTS:
            raise ValueError(f"pin_cost must be one of {PIN_COSTS}, got {pin_cost!r}")
        if not (max_ttl_s > 0 and math.isfinite(max_ttl_s)):
            raise ValueError(f"max_ttl_s must be a positive finite number, got {max_ttl_s!r}")
        self.cold_start_samples = cold_start_samples
        self.min_tool_samples = min_tool_samples
        self.prefill_cost = prefill_cost
        self.reload_cost = reload_cost
        self.rebuild_cost = rebuild_cost
        self.pin_cost = pin_cost
        self.max_ttl_s = float(max_ttl_s)
        self.predictor = predictor
        self.queueing_delay = SlidingMean(queueing_window)
        self.turns = RemainingTurnsCorrelation()
        self.recent_calls = RecentCalls(self.history.max_pending)
        self.records: deque[DurationRecord] = deque(maxlen=max_records)
        if refit_every is not None and refit_every < 1:
            raise ValueError(f"refit_every must be >= 1, got {refit_every}")
        self.refit_every = refit_every
        self.refit_in_background = refit_in_background
        self._num_new_records = 0
        self._refit_thread: threading.Thread | None = None
        self._cdfs: dict[str | None, DurationCDF] = {}

    # The TTL.
    def decide(self, call: ToolCall) -> TTLDecision:
        """Eq. 2's TTL for the call, in [0, `max_ttl_s`] seconds, with its inputs."""
        queueing_delay_s = self.queueing_delay.mean or 0.0
        rebuild_s = self.rebuild_s(call.num_context_tokens)
        if self.rebuild_cost == "prefill-times-running":
            rebuild_s *= 1 + clamp_count(call.num_running_requests, MAX_RUNNING_REQUESTS)
        num_samples = len(self.history.samples(None))
        price = None
        if num_samples <= self.cold_start_samples:
            eta, basis = 1.0, "cold-start"
            benefit_s = queueing_delay_s + rebuild_s
            ttl_s = cold_start_ttl(benefit_s)
        else:
            eta = self.turns.eta
            benefit_s = queueing_delay_s * eta + rebuild_s
            cdf, basis, num_samples = self._cdf(call)
            price = self.memory_price(call) if self.pin_cost in PRICED_PIN_COSTS else None
            ttl_s = solve_ttl(cdf, benefit_s, self.pin_cost,
                              price=1.0 if price is None else price)
        ttl_s = min(ttl_s, self.max_ttl_s) if ttl_s >= 0 else 0.0
        return TTLDecision(ttl_s, basis, num_samples=num_samples,
                           queueing_delay_s=queueing_delay_s, eta=eta, rebuild_s=rebuild_s,
                           benefit_s=benefit_s, memory_price=price)

    def memory_price(self, call: ToolCall) -> float:
        """Seconds of delay the call's pin causes the requests running and waiting per second
        it is held (`pin_cost="priced"`), their count bounded by what the pool holds
        (`"priced-capped"`), and 0 with `"priced-capped"` while no request waits: every
        request runs, and one short of blocks takes pins before it preempts (docs/decisions/
        0005-pins-before-preemption.md). Called by `decide` for each decision past the cold
        start with one of those pin costs."""
        if self.pin_cost == "priced-capped" and call.num_waiting_requests == 0:
            return 0.0
        num_active = clamp_count(call.num_running_requests + call.num_waiting_requests,
                                 MAX_RUNNING_REQUESTS)
        capacity = (pool_capacity_requests(clamp_count(call.num_running_requests,
                                                       MAX_RUNNING_REQUESTS),
                                           call.running_pool_share)
                    if self.pin_cost == "priced-capped" else None)
        return memory_price(call.pool_share, num_active, capacity)

    def rebuild_s(self, num_context_tokens: int) -> float:
        """R: seconds to rebuild a context of this many tokens: its reload time when the host
        tier can hold it, else its prefill time."""
        reload_s = (None if self.reload_cost is None
                    else self.reload_cost.cost_s(num_context_tokens))
        if reload_s is not None:
            return reload_s
        if self.prefill_cost is None:
            return 0.0
        return self.prefill_cost.cost_s(num_context_tokens)

    def _cdf(self, call: ToolCall) -> tuple[DurationCDF, str, int]:
        if self.predictor is not None and self.predictor.is_fitted:
            return self.predictor.predict_cdf(self.features(call)), "learned", len(self.records)
        tool_samples = self.history.samples(call.tool_name)
        tool = call.tool_name if len(tool_samples) > self.min_tool_samples else None
        cdf = self._cdfs.get(tool)
        if cdf is None:
            if len(self._cdfs) > self.history.max_tools:
                self._cdfs.clear()  # entries of tools the history has forgotten
            cdf = self._cdfs[tool] = DurationCDF.from_samples(self.history.samples(tool))
        return cdf, "pooled" if tool is None else "tool", len(self.history.samples(tool))

    def features(self, call: ToolCall) -> CallFeatures:
        """What the predictor sees of the call (counts clamped to their bounds)."""
        return CallFeatures.bounded(call.tool_name, call.turn_index, call.num_context_tokens,
                                    self.recent_calls.of(call.job_id))

    # Observations.
    def observe_tool_call(self, call: ToolCall) -> None:
        self.history.start(call)

    def observe_next_turn(self, job_id: str, arrived_at_s: float) -> None:
        finished = self.history.finish_call(job_id, arrived_at_s)
        if finished is None:
            return
        call, duration_s = finished
        self.records.append(DurationRecord(self.features(call), duration_s))
        self.recent_calls.add(job_id, call.tool_name, duration_s)
        self._forget_cdfs(call.tool_name)
        self._num_new_records += 1
        if self.refit_every is not None and self._num_new_records >= self.refit_every:
            self._start_refit()

    def observe_queueing_delay(self, delay_s: float) -> None:
        """A turn that came back without its KV waited `delay_s` seconds (clamped into [0,
        `MAX_OBSERVED_S`]; NaN is ignored)."""
        self.queueing_delay.add(delay_s)

    def observe_job_end(self, job_id: str, num_turns: int) -> None:
        """The job ended after `num_turns` turns (counted up to `MAX_JOB_TURNS`)."""
        self.turns.add(clamp_count(num_turns, MAX_JOB_TURNS))
        self.history.forget_job(job_id)
        self.recent_calls.forget(job_id)

    def _forget_cdfs(self, tool_name: str | None) -> None:
        self._cdfs.pop(None, None)
        self._cdfs.pop(tool_name, None)

    # Learning from elsewhere.
    def warm_start(self, jobs: Iterable[TraceJob]) -> None:
        """Learns durations, job lengths and (for a predictor) training records from traces,
        as if the jobs had run here; a predictor is then refitted."""
        for job in jobs:
            recent = RecentCalls(1)
            for call in job.calls:
                duration_s = clamp_seconds(call.duration_s)
                if duration_s is None:
                    continue
                features = CallFeatures.bounded(call.tool_name, call.turn_index,
                                                call.num_context_tokens, recent.of(job.job_id))
                self.records.append(DurationRecord(features, duration_s))
                self.history.add(call.tool_name, duration_s)
                recent.add(job.job_id, call.tool_name, duration_s)
            self.turns.add(clamp_count(job.num_turns, MAX_JOB_TURNS))
        self._cdfs.clear()
        self.refit()

    def refit(self) -> None:
        """Retrains the predictor on the recorded calls now (no-op without one)."""
        if self.predictor is not None:
            self.predictor.fit(list(self.records))
        self._num_new_records = 0

    def _start_refit(self) -> None:
        """Trains a copy of the predictor on a snapshot of the records and swaps it in; one
        refit at a time."""
        if self.predictor is None or (self._refit_thread and self._refit_thread.is_alive()):
            return
        self._num_new_records = 0
        trainee, records = self.predictor.unfitted_copy(), list(self.records)

        def train() -> None:
            try:
                trainee.fit(records)
            except Exception:  # a failed refit keeps the current predictor
                logger.exception("retraining the duration predictor failed")
                return
            if trainee.is_fitted:
                self.predictor = trainee  # one reference swap: the step thread sees either

        if self.refit_in_background:
            self._refit_thread = threading.Thread(target=train, name="predictor-refit",
                                                  daemon=True)
            self._refit_thread.start()
        else:
            train()

    def wait_for_refit(self, timeout_s: float | None = None) -> None:
        """Blocks until a background refit in progress has finished (tests, shutdown)."""
        if self._refit_thread is not None:
            self._refit_thread.join(timeout_s)

    # State.
    def state(self) -> dict[str, Any]:
        """Everything learned, as JSON-ready data (pending calls are not kept)."""
        return {
            "version": STATE_VERSION,
            "cold_start_samples": self.cold_start_samples,
            "pooled_s": list(self.history.samples(None)),
            "tools_s": {name: list(self.history.samples(name))
                        for name in self.history.tool_names},
            "queueing_delays_s": self.queueing_delay.values,
            "job_num_turns": self.turns.num_turns,
            "prefill_cost": None if self.prefill_cost is None else self.prefill_cost.to_dict(),
            "records": [[r.features.to_list(), r.duration_s] for r in self.records],
        }

    def load_state(self, state: object) -> None:
        """Replaces what was learned with a saved `state()`; ValueError (and no change) if it
        is not one, or if what it implies is not sound: a value out of bounds, a sum or mean
        that is not finite, an implausible prefill cost (`PrefillCostModel.check_plausible`;
        refused even when the estimator's own is used), or a predictor that cannot be trained
        on it. Of each list only the latest entries this estimator keeps are read. The
        state's prefill cost is taken only if the estimator has none. The reload cost is
        never saved nor loaded: it describes this engine's host tier, measured at start."""
        fresh = self._blank_copy()
        try:
            fresh._apply_state(state)
            if self.prefill_cost is not None:
                fresh.prefill_cost = self.prefill_cost  # a measured or given profile wins
            if self.predictor is not None:
                fresh.predictor = self.predictor.unfitted_copy()
                fresh.predictor.fit(list(fresh.records))
            fresh._check_sound()
        except Exception as error:  # whatever a malformed file makes parsing or training raise
            raise ValueError(f"not an estimator state: {type(error).__name__}: {error}") from error
        self.history, self.queueing_delay, self.turns = (
            fresh.history, fresh.queueing_delay, fresh.turns
        )
        self.records, self.recent_calls, self._cdfs = fresh.records, fresh.recent_calls, {}
        self.prefill_cost, self.predictor = fresh.prefill_cost, fresh.predictor
        self._num_new_records = 0

    def _blank_copy(self) -> Eq2Estimator:
        """An estimator with this one's settings and bounds that has learned nothing."""
        return Eq2Estimator(
            reload_cost=self.reload_cost,
            rebuild_cost=self.rebuild_cost, pin_cost=self.pin_cost, max_ttl_s=self.max_ttl_s,
            cold_start_samples=self.cold_start_samples, min_tool_samples=self.min_tool_samples,
            history=ToolDurationHistory(max_samples=self.history.max_samples,
                                        max_tools=self.history.max_tools,
                                        max_pending=self.history.max_pending),
            queueing_window=self.queueing_delay.window, max_records=self.records.maxlen or 1,
            refit_every=self.refit_every, refit_in_background=self.refit_in_background,
        )

    def _apply_state(self, state: Any) -> None:
        if state["version"] != STATE_VERSION:
            raise ValueError(f"unsupported version {state['version']!r}")
        max_samples = self.history.max_samples
        tools = state["tools_s"]
        if not isinstance(tools, dict):
            raise ValueError("tools_s must be an object")
        for name, samples in list(tools.items())[-self.history.max_tools:]:
            for value in _latest(samples, max_samples):
                self.history.add_to_tool(str(name), bounded_duration_s(value))
        self.history.extend_pooled(
            [bounded_duration_s(value) for value in _latest(state["pooled_s"], max_samples)]
        )
        for value in _latest(state["queueing_delays_s"], self.queueing_delay.window):
            self.queueing_delay.add(bounded_duration_s(value))
        self.turns.extend(int(n) for n in _latest(state["job_num_turns"], self.turns.max_jobs))
        if state.get("prefill_cost") is not None:
            self.prefill_cost = PrefillCostModel.from_dict(state["prefill_cost"])
            self.prefill_cost.check_plausible()
        for features, duration_s in _latest(state["records"], self.records.maxlen or 1):
            self.records.append(DurationRecord(CallFeatures.from_list(features),
                                               bounded_duration_s(duration_s)))

    def _check_sound(self) -> None:
        """ValueError unless every sum and mean of what was learned is finite and a decision
        for a long context comes out for every tool."""
        sample_sets = [("pooled_s", self.history.samples(None)),
                       ("queueing_delays_s", self.queueing_delay.values),
                       ("records", [record.duration_s for record in self.records])]
        sample_sets += [(f"tools_s[{name!r}]", self.history.samples(name))
                        for name in self.history.tool_names]
        for name, values in sample_sets:
            if not math.isfinite(math.fsum(values)):
                raise ValueError(f"the sum of {name} is not finite")
        if not math.isfinite(self.turns.eta):
            raise ValueError("eta is not finite")
        learned = self.predictor is not None and self.predictor.is_fitted
        tools = [None] if learned else [None, *self.history.tool_names]  # one CDF per tool
        for tool in tools:
            self.decide(ToolCall("state-check", tool, 0.0, PLAUSIBILITY_CONTEXT_TOKENS, 0))


def _latest(values: object, count: int) -> list:
    """The last `count` items of a JSON list; ValueError if it is not a list."""
    if not isinstance(values, list):
        raise ValueError(f"expected a list, got {type(values).__name__}")
    return values[-count:]
