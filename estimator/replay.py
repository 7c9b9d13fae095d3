"""Agent jobs' tool calls replayed through TTL estimators, and their decisions scored: the
replay behind `continuum bench estimator` (`eval.bench.estimator`).

Jobs are split by arrival time: estimators learn from the earlier `train_fraction` of them
(`warm_start`), then the later jobs' tool calls are replayed in time order (a turn finishes
`turn_time_s` after its prompt arrives, its tool runs for the recorded duration `d`, then the
next turn arrives), each estimator deciding a TTL `tau` at every finish and learning online.
There is no engine: the queueing delay `T` that a turn returning without its KV suffers is an
assumption (`queueing_delay_s`), `R` comes from a prefill cost model and `eta` from all the
trace's jobs, so a hit saves `B = T * eta + R(context)`. A call is a hit when it was pinned
(`tau > 0`) and its next turn arrives within the TTL (`d <= tau`), else a miss (the pin
expired, or there was none).

Each estimator is scored twice, per call and averaged over all calls:

- `mean_utility` (the engine's accounting): a hit scores `B - d`, since a pin holds memory
  only until the next turn claims it (`min(d, tau) = d`); a pinned miss scores `-tau`; no pin
  scores 0. The estimator learns `T` as in the engine, where only turns that come back without
  their KV report a queueing delay: at every miss, when the next turn arrives, it observes a
  delay of `T` (`observe_queueing_delay`). Until its first miss it knows no delay (`T = 0`).
- `mean_utility_ttl_cost_handed_T` (the benchmark's earlier scoring, kept for comparison): a
  second replay from the same warm start in which the estimator is handed `T` once, before the
  replay, and observes no delay after; every pin costs its whole TTL: a hit scores `B - tau`,
  a pinned miss `-tau`. `mean_utility_handed_T` scores that replay as `mean_utility` does,
  which separates the two changes. The handed-`T` replay's own statistics are under
  `handed_T`.

The learned predictor is trained once, on the earlier jobs. `oracle` knows each duration and
`T` in advance and pins for exactly `d` when `B > d`: an upper bound under both scorings, on
which it scores the same (its TTL is the duration).
"""

from __future__ import annotations

import copy
import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from estimator.cost_model import PrefillCostModel
from estimator.eq2 import COLD_START_SAMPLES, Eq2Estimator
from estimator.estimator_registry import ESTIMATORS, EstimatorSettings, make_estimator
from estimator.learned import QuantileBoostingPredictor, pinball_loss
from estimator.predictor import CallFeatures, DurationRecord, RecentCalls
from estimator.signals import RemainingTurnsCorrelation
from estimator.solver import DurationCDF, PinCost
from estimator.traces import TraceJob
from estimator.ttl_estimator import ToolCall, TTLDecision, TTLEstimator


@dataclass
class Outcome:
    """The running totals of one estimator's decisions over one replay (seconds)."""

    num_calls: int = 0
    num_pinned: int = 0
    num_hits: int = 0
    ttl_total_s: float = 0.0
    held_total_s: float = 0.0
    wasted_pin_s: float = 0.0
    saved_total_s: float = 0.0
    queueing_delay_total_s: float = 0.0
    num_with_queueing_delay: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def add(self, decision: TTLDecision, duration_s: float, benefit_s: float) -> bool:
        """Scores a decision for a call whose tool ran `duration_s` and whose hit would save
        `benefit_s`; True if it is a hit."""
        self.num_calls += 1
        if decision.queueing_delay_s is not None:
            self.queueing_delay_total_s += decision.queueing_delay_s
            self.num_with_queueing_delay += 1
        ttl_s = decision.ttl_s
        if ttl_s <= 0:
            return False
        hit = duration_s <= ttl_s
        self.num_pinned += 1
        self.num_hits += hit
        self.ttl_total_s += ttl_s
        self.held_total_s += min(duration_s, ttl_s)
        self.wasted_pin_s += 0.0 if hit else ttl_s
        self.saved_total_s += benefit_s if hit else 0.0
        return hit

    def report(self) -> dict[str, Any]:
        """`hit_rate` is per pin, `reuse_rate` per call; `mean_ttl_s` and `mean_held_s` (the
        memory a pin held: min(duration, TTL)) are over pins; `mean_T_s` is the mean queueing
        delay the estimator's decisions used (None if it uses none); `mean_utility` charges a
        pin what it held, `mean_utility_ttl_cost` its whole TTL (see the module docstring)."""
        calls = max(1, self.num_calls)
        pins = max(1, self.num_pinned)
        return {
            "num_calls": self.num_calls,
            "pin_rate": self.num_pinned / calls,
            "hit_rate": self.num_hits / pins,
            "reuse_rate": self.num_hits / calls,
            "wasted_pin_s": self.wasted_pin_s,
            "mean_ttl_s": self.ttl_total_s / pins,
            "mean_held_s": self.held_total_s / pins,
            "mean_T_s": (self.queueing_delay_total_s / self.num_with_queueing_delay
                         if self.num_with_queueing_delay else None),
            "mean_utility": (self.saved_total_s - self.held_total_s) / calls,
            "mean_utility_ttl_cost": (self.saved_total_s - self.ttl_total_s) / calls,
            **self.extra,
        }


@dataclass(frozen=True)
class Scorer:
    """The benefit a hit brings: `T * eta + R(context)`, in seconds."""

    queueing_delay_s: float
    eta: float
    prefill_cost: PrefillCostModel

    def benefit_s(self, num_context_tokens: int) -> float:
        return self.queueing_delay_s * self.eta + self.prefill_cost.cost_s(num_context_tokens)


def split_by_arrival(jobs: Sequence[TraceJob], train_fraction: float
                     ) -> tuple[list[TraceJob], list[TraceJob]]:
    """(earlier jobs, later jobs) by arrival time; file order breaks ties."""
    if not 0 <= train_fraction < 1:
        raise ValueError(f"train_fraction must be in [0, 1), got {train_fraction}")
    ordered = sorted(jobs, key=lambda job: job.arrival_s)
    cut = int(len(ordered) * train_fraction)
    return ordered[:cut], ordered[cut:]


def replay(jobs: Sequence[TraceJob], estimator: TTLEstimator, scorer: Scorer, *,
           learn_queueing_delay: bool = True) -> Outcome:
    """Feeds the jobs' tool calls through the estimator in time order and scores each TTL:
    a turn's finish (a decision), its next turn's arrival (an observation) and a job's end
    are events on one clock, so no decision sees a duration that has not ended yet.

    With `learn_queueing_delay`, the estimator observes the scorer's `T` as a queueing delay
    each time a call's next turn arrives after a miss; without, it is handed `T` once before
    the replay (the benchmark's earlier protocol)."""
    outcome = Outcome()
    events: list[tuple[float, int, str, int, int]] = []  # time, tie-break, kind, job, call
    sequence = itertools.count()
    pending_hits: dict[int, bool] = {}  # job index -> whether its running tool call hit

    def push(time_s: float, kind: str, job_index: int, call_index: int) -> None:
        heapq.heappush(events, (time_s, next(sequence), kind, job_index, call_index))

    if not learn_queueing_delay:
        estimator.observe_queueing_delay(scorer.queueing_delay_s)
    for job_index, job in enumerate(jobs):
        first_turn_s = job.calls[0].turn_time_s if job.calls else 0.0
        push(job.arrival_s + first_turn_s, "finish", job_index, 0)
    while events:
        now_s, _, kind, job_index, call_index = heapq.heappop(events)
        job = jobs[job_index]
        if kind == "arrive":
            estimator.observe_next_turn(job.job_id, now_s)
            if learn_queueing_delay and not pending_hits.pop(job_index):
                estimator.observe_queueing_delay(scorer.queueing_delay_s)
            following = job.calls[call_index] if call_index < len(job.calls) else None
            push(now_s + (following.turn_time_s if following else 0.0), "finish", job_index,
                 call_index)
        elif call_index >= len(job.calls):
            estimator.observe_job_end(job.job_id, job.num_turns)
        else:
            call = job.calls[call_index]
            tool_call = ToolCall(job.job_id, call.tool_name, now_s, call.num_context_tokens,
                                 call.turn_index)
            estimator.observe_tool_call(tool_call)
            pending_hits[job_index] = outcome.add(estimator.decide(tool_call), call.duration_s,
                                                  scorer.benefit_s(call.num_context_tokens))
            push(now_s + call.duration_s, "arrive", job_index, call_index + 1)
    return outcome


def oracle(jobs: Sequence[TraceJob], scorer: Scorer) -> Outcome:
    """Pins for exactly the call's duration whenever the saving beats it."""
    outcome = Outcome()
    for job in jobs:
        for call in job.calls:
            benefit_s = scorer.benefit_s(call.num_context_tokens)
            # A duration of 0 still needs a pin, however short.
            ttl_s = max(call.duration_s, 1e-9) if call.duration_s < benefit_s else 0.0
            outcome.add(TTLDecision(ttl_s, "oracle"), call.duration_s, benefit_s)
    return outcome


def test_records(jobs: Sequence[TraceJob]) -> list[DurationRecord]:
    """Each call of the jobs with the features known when it started."""
    records = []
    for job in jobs:
        recent = RecentCalls(1)
        for call in job.calls:
            features = CallFeatures.bounded(call.tool_name, call.turn_index,
                                            call.num_context_tokens, recent.of(job.job_id))
            records.append(DurationRecord(features, call.duration_s))
            recent.add(job.job_id, call.tool_name, call.duration_s)
    return records


class _PrecomputedPredictor:
    """A fitted predictor's CDFs for known calls, computed in one batch (a replay's calls
    are known in advance; predicting them one by one costs milliseconds each)."""

    def __init__(self, predictor: QuantileBoostingPredictor, features: list[CallFeatures]):
        self._predictor = predictor
        quantiles = predictor.predict_quantiles(features) if features else []
        self._cdfs = {f: DurationCDF.from_quantiles(predictor.levels, row)
                      for f, row in zip(features, quantiles, strict=True)}

    @property
    def is_fitted(self) -> bool:
        return self._predictor.is_fitted

    def fit(self, records: Sequence[DurationRecord]) -> None:
        raise NotImplementedError("a precomputed predictor does not retrain")

    def unfitted_copy(self) -> QuantileBoostingPredictor:
        return self._predictor.unfitted_copy()

    def predict_cdf(self, features: CallFeatures) -> DurationCDF:
        cdf = self._cdfs.get(features)
        return self._predictor.predict_cdf(features) if cdf is None else cdf


def pinball_losses(estimator: Eq2Estimator, records: list[DurationRecord]
                   ) -> tuple[float | None, float | None]:
    """(empirical, learned) pinball loss on `records`: the per-tool empirical quantiles the
    estimator learned (pooled for tools with too few samples), and its predictor's."""
    levels = QuantileBoostingPredictor().levels
    actual = np.array([r.duration_s for r in records])
    if not records or not estimator.history.samples(None):
        return None, None  # nothing to predict, or nothing learned to predict it with
    empirical = []
    for record in records:
        samples = estimator.history.samples(record.features.tool_name)
        if len(samples) <= estimator.min_tool_samples:
            samples = estimator.history.samples(None)
        cdf = DurationCDF.from_samples(samples)
        empirical.append([cdf.quantile(level) for level in levels])
    learned = None
    predictor = estimator.predictor
    if isinstance(predictor, QuantileBoostingPredictor) and predictor.is_fitted:
        learned = pinball_loss(levels, predictor.predict_quantiles(
            [r.features for r in records]), actual)
    return pinball_loss(levels, np.array(empirical), actual), learned


def compare_estimators(
    jobs: Sequence[TraceJob], *, train_fraction: float, queueing_delay_s: float,
    prefill_cost: PrefillCostModel,
) -> dict[str, dict[str, Any]]:
    """The report of every named estimator, then the oracle's: the learned-`T` replay's
    statistics, both scorings' utilities, and the handed-`T` replay's report (`handed_T`)."""
    train, test = split_by_arrival(jobs, train_fraction)
    turns = RemainingTurnsCorrelation(max_jobs=max(1, len(jobs)))
    turns.extend(job.num_turns for job in jobs)
    scorer = Scorer(queueing_delay_s, turns.eta, prefill_cost)
    records = test_records(test)
    results: dict[str, dict[str, Any]] = {}
    for row, (name, pin_cost) in _rows().items():
        # The paper's Eq. 2 (R the prefill alone, its cold start), whose pin cost the row names.
        settings = EstimatorSettings(prefill_cost=prefill_cost, pin_cost=pin_cost,
                                     rebuild_cost="prefill",
                                     cold_start_samples=COLD_START_SAMPLES)
        estimator, extra = _prepared_estimator(name, settings, train, records)
        handed = replay(test, copy.deepcopy(estimator), scorer, learn_queueing_delay=False)
        learned = replay(test, estimator, scorer)
        results[row] = _both_scorings(learned.report(), handed.report(), extra)
    best = oracle(test, scorer).report()
    results["oracle"] = _both_scorings(best, best, {})
    return results


def _rows() -> dict[str, tuple[str, PinCost]]:
    """Each row: (estimator name, what Eq. 2 charges a pin); the Eq. 2 estimators also run
    with the `expected-hold` option, as `NAME+expected-hold`."""
    rows: dict[str, tuple[str, PinCost]] = {name: (name, "ttl") for name in ESTIMATORS}
    for name in ("eq2-empirical", "eq2-learned"):
        rows[f"{name}+expected-hold"] = (name, "expected-hold")
    return rows


def _prepared_estimator(name: str, settings: EstimatorSettings, train: Sequence[TraceJob],
                        records: list[DurationRecord]
                        ) -> tuple[TTLEstimator, dict[str, Any]]:
    """A named estimator warm-started on `train`, and its report's extra columns; a learned
    predictor is trained once and answers from CDFs precomputed for `records`."""
    estimator = make_estimator(name, settings)
    estimator.warm_start(train)
    extra: dict[str, Any] = {}
    if isinstance(estimator, Eq2Estimator):
        empirical_loss, learned_loss = pinball_losses(estimator, records)
        learned = isinstance(estimator.predictor, QuantileBoostingPredictor)
        extra["pinball_loss"] = learned_loss if learned else empirical_loss
        if isinstance(estimator.predictor, QuantileBoostingPredictor):
            # Trained once on the earlier jobs: a refit mid-replay would make the result
            # depend on thread timing.
            estimator.refit_every = None
            extra["fitted"] = estimator.predictor.is_fitted
            estimator.predictor = _PrecomputedPredictor(
                estimator.predictor, [r.features for r in records]
            ) if estimator.predictor.is_fitted else None
    return estimator, extra


def _both_scorings(learned: dict[str, Any], handed: dict[str, Any], extra: dict[str, Any]
                   ) -> dict[str, Any]:
    """The learned-`T` replay's report (less its TTL-cost utility, a mix of the two
    scorings) with the handed-`T` replay's utilities and report."""
    report = {key: value for key, value in learned.items() if key != "mean_utility_ttl_cost"}
    report["mean_utility_handed_T"] = handed["mean_utility"]
    report["mean_utility_ttl_cost_handed_T"] = handed["mean_utility_ttl_cost"]
    report["handed_T"] = handed
    report.update(extra)
    return report
