"""The Continuum estimator: Eq. 2 of the paper over observed (or predicted) tool durations.

For a finished turn that called tool `f` with a context of `r` tokens:
`ttl = argmax over t in {0} and samples(f) of P(t) * (T * eta + R(r)) - t`, where `P` is the
empirical CDF of `f`'s durations, `T` the recent mean queueing delay of turns that came back
without their KV, `eta` the anti-correlation of jobs' done and remaining turns, and `R` the
cost of rebuilding `r` tokens. With at most `cold_start_samples` (K) samples overall, durations
are assumed Exp(mean 1 s) and eta = 1, giving `ttl = ln(T + R)` when `T + R > 1`; beyond K
overall but at most K for `f`, the pooled CDF of all tools is used. With a fitted
`predictor`, the CDF is instead the predictor's conditional distribution for the call.

Our refinement of `R`: the paper prices a rebuild as the prefill time of `r` tokens. In an
engine that batches prefill and decode tokens into one step, that prefill lengthens the steps
of every request running beside it, so `R = prefill_s(r) * (1 + n)` with `n` the other
requests running when the turn finished (`ToolCall.num_running_requests`). Alone on the
engine it is the paper's `R`; under load it makes losing a long context correctly dear. The
simulated comparison in `docs/benchmarks.md` measures what it changes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from estimator.base import ToolCall
from estimator.cost_model import PrefillCostModel
from estimator.history import ToolDurationHistory
from estimator.predictor import CallFeatures, DurationPredictor, DurationRecord, RecentCalls
from estimator.signals import RemainingTurnsCorrelation, SlidingMean
from estimator.solver import DurationCDF, cold_start_ttl, solve_ttl
from estimator.traces import TraceJob

logger = logging.getLogger(__name__)

COLD_START_SAMPLES = 100
STATE_VERSION = 1


@dataclass(frozen=True, slots=True)
class TTLDecision:
    """One TTL decision and its inputs (seconds), for traces and explanations.

    `basis` says which distribution decided: "cold-start", "tool", "pooled" or "learned".
    """

    ttl_s: float
    benefit_s: float
    queueing_delay_s: float
    eta: float
    rebuild_s: float
    num_samples: int
    basis: str


class Eq2Estimator:
    """Owned by one policy (single-threaded); see the module docstring for the rule.

    `prefill_cost` prices `R` (None: R = 0); `predictor`, once fitted, replaces the
    empirical CDF; `max_records` bounds the finished calls kept to (re)train it. With
    `refit_every`, a copy of the predictor is retrained on the records after that many new
    ones, in a background thread (`refit_in_background`) so that no scheduler step waits for
    it, and swapped in when done.
    """

    def __init__(
        self,
        *,
        prefill_cost: PrefillCostModel | None = None,
        predictor: DurationPredictor | None = None,
        cold_start_samples: int = COLD_START_SAMPLES,
        history: ToolDurationHistory | None = None,
        queueing_window: int = 256,
        max_records: int = 20_000,
        refit_every: int | None = None,
        refit_in_background: bool = True,
    ) -> None:
        self.history = ToolDurationHistory() if history is None else history
        if not 0 <= cold_start_samples < self.history.max_samples:
            raise ValueError(
                f"cold_start_samples must be in [0, {self.history.max_samples}), "
                f"got {cold_start_samples}"
            )
        self.cold_start_samples = cold_start_samples
        self.prefill_cost = prefill_cost
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
        self.last_decision: TTLDecision | None = None

    # The TTL.
    def ttl_s(self, call: ToolCall) -> float:
        return self.decide(call).ttl_s

    def decide(self, call: ToolCall) -> TTLDecision:
        """The TTL for the call with its inputs; also kept as `last_decision`."""
        queueing_delay_s = self.queueing_delay.mean or 0.0
        rebuild_s = self.rebuild_s(call.num_context_tokens) * (1 + call.num_running_requests)
        num_samples = len(self.history.samples(None))
        if num_samples <= self.cold_start_samples:
            benefit_s = queueing_delay_s + rebuild_s
            decision = TTLDecision(cold_start_ttl(benefit_s), benefit_s, queueing_delay_s, 1.0,
                                   rebuild_s, num_samples, "cold-start")
        else:
            eta = self.turns.eta
            benefit_s = queueing_delay_s * eta + rebuild_s
            cdf, basis, num_samples = self._cdf(call)
            decision = TTLDecision(solve_ttl(cdf, benefit_s), benefit_s, queueing_delay_s, eta,
                                   rebuild_s, num_samples, basis)
        self.last_decision = decision
        return decision

    def rebuild_s(self, num_context_tokens: int) -> float:
        """R: seconds to rebuild a context of this many tokens."""
        return 0.0 if self.prefill_cost is None else self.prefill_cost.cost_s(num_context_tokens)

    def _cdf(self, call: ToolCall) -> tuple[DurationCDF, str, int]:
        if self.predictor is not None and self.predictor.is_fitted:
            return self.predictor.predict_cdf(self.features(call)), "learned", len(self.records)
        tool_samples = self.history.samples(call.tool_name)
        tool = call.tool_name if len(tool_samples) > self.cold_start_samples else None
        cdf = self._cdfs.get(tool)
        if cdf is None:
            if len(self._cdfs) > self.history.max_tools:
                self._cdfs.clear()  # entries of tools the history has forgotten
            cdf = self._cdfs[tool] = DurationCDF.from_samples(self.history.samples(tool))
        return cdf, "pooled" if tool is None else "tool", len(self.history.samples(tool))

    def features(self, call: ToolCall) -> CallFeatures:
        return CallFeatures(call.tool_name, call.turn_index, call.num_context_tokens,
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
        if math.isfinite(delay_s):
            self.queueing_delay.add(max(0.0, delay_s))

    def observe_job_end(self, job_id: str, num_turns: int) -> None:
        self.turns.add(num_turns)
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
                features = CallFeatures(call.tool_name, call.turn_index, call.num_context_tokens,
                                        recent.of(job.job_id))
                self.records.append(DurationRecord(features, call.duration_s))
                self.history.add(call.tool_name, call.duration_s)
                recent.add(job.job_id, call.tool_name, call.duration_s)
            self.turns.add(job.num_turns)
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
        is not one."""
        fresh = Eq2Estimator(cold_start_samples=self.cold_start_samples,
                             queueing_window=self.queueing_delay.window,
                             max_records=self.records.maxlen or 1,
                             history=ToolDurationHistory(
                                 max_samples=self.history.max_samples,
                                 max_tools=self.history.max_tools,
                                 max_pending=self.history.max_pending))
        predictor = None if self.predictor is None else self.predictor.unfitted_copy()
        try:
            fresh._apply_state(state)
            if predictor is not None:
                predictor.fit(list(fresh.records))
        except Exception as error:  # whatever a malformed file makes parsing or training raise
            raise ValueError(f"not an estimator state: {type(error).__name__}: {error}") from error
        self.history, self.queueing_delay, self.turns = (
            fresh.history, fresh.queueing_delay, fresh.turns
        )
        self.records, self.recent_calls, self._cdfs = fresh.records, fresh.recent_calls, {}
        if fresh.prefill_cost is not None:
            self.prefill_cost = fresh.prefill_cost
        if predictor is not None:
            self.predictor = predictor
        self._num_new_records = 0

    def _apply_state(self, state: Any) -> None:
        if state["version"] != STATE_VERSION:
            raise ValueError(f"unsupported version {state['version']!r}")
        tools = state["tools_s"]
        pooled = [_duration(value) for value in state["pooled_s"]]
        for name, samples in tools.items():
            for value in samples:
                self.history.add_to_tool(str(name), _duration(value))
        self.history.extend_pooled(pooled)
        for value in state["queueing_delays_s"]:
            self.queueing_delay.add(_duration(value))
        self.turns.extend(int(n) for n in state["job_num_turns"])
        if state.get("prefill_cost") is not None:
            self.prefill_cost = PrefillCostModel.from_dict(state["prefill_cost"])
        for features, duration_s in state["records"]:
            self.records.append(DurationRecord(CallFeatures.from_list(features),
                                               _duration(duration_s)))

    def save(self, path: str | Path) -> None:
        """Writes `state()` as JSON, atomically (a synced temporary file, then a rename)."""
        path = Path(path)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.",
                                         delete=False) as temporary:
            json.dump(self.state(), temporary)
            temporary.flush()
            os.fsync(temporary.fileno())
        Path(temporary.name).replace(path)

    def load(self, path: str | Path) -> None:
        """Loads a saved state file; ValueError (and no change) if it is unreadable."""
        try:
            state = json.loads(Path(path).read_text())
        except (OSError, ValueError, RecursionError) as error:
            raise ValueError(f"cannot read estimator state {path}: {error}") from error
        self.load_state(state)

    def load_or_cold_start(self, path: str | Path) -> bool:
        """Loads the state file if there is one; a missing one is a cold start, a corrupt one
        too, with a warning. True if a state was loaded."""
        if not Path(path).exists():
            return False
        try:
            self.load(path)
        except ValueError as error:
            logger.warning("estimator state ignored, starting cold: %s", error)
            return False
        return True


def _duration(value: object) -> float:
    duration_s = float(value)  # type: ignore[arg-type]
    if not (duration_s >= 0 and math.isfinite(duration_s)):
        raise ValueError(f"bad duration {value!r}")
    return duration_s
