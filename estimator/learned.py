"""A learned conditional distribution of tool durations: gradient-boosted quantile regression.

One scikit-learn `HistGradientBoostingRegressor` per quantile level predicts the log duration
from the tool, its command word (`python` of `python -m pytest`), the turn index, the context
length and the job's recent durations (the last one, the mean of the last three, the last of
the same tool). Quantiles of the log are quantiles of the duration, and the log tames the
heavy tail. The predicted quantiles form the CDF that Eq. 2's solver maximises over.

Tools and commands are coded by frequency rank (unknown: missing) and split on as numbers:
declaring them categorical gave the same loss on the SWE trace at twice the prediction cost.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

from estimator.predictor import CallFeatures, DurationRecord
from estimator.solver import DurationCDF
from estimator.ttl_estimator import (
    MAX_CONTEXT_TOKENS,
    MAX_JOB_TURNS,
    MAX_OBSERVED_S,
    clamp_count,
    clamp_seconds,
)

QUANTILE_LEVELS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.975, 0.99)
_LOG_OFFSET_S = 1e-3  # durations of 0 s exist (in-process editors)
_MAX_TOOLS = 1000
# Missing values (unknown tool, no earlier call) as a number below every real feature value:
# scikit-learn's native NaN handling fails on a column that is all missing.
_MISSING = -100.0


class QuantileBoostingPredictor:
    """Implements `DurationPredictor`; training is deterministic for a `seed`.

    `min_records`: fewer finished calls than this leave it unfitted (the empirical CDF then
    decides).
    """

    def __init__(
        self,
        *,
        levels: Sequence[float] = QUANTILE_LEVELS,
        max_iter: int = 150,
        learning_rate: float = 0.1,
        min_records: int = 100,
        seed: int = 0,
    ) -> None:
        if not levels or any(not 0 < q < 1 for q in levels) or list(levels) != sorted(levels):
            raise ValueError(f"levels must be increasing within (0, 1), got {levels!r}")
        self.levels = tuple(float(q) for q in levels)
        self.max_iter = max_iter
        self.learning_rate = learning_rate
        self.min_records = min_records
        self.seed = seed
        self._models: list = []
        self._tool_codes: dict[str, int] = {}
        self._command_codes: dict[str, int] = {}

    @property
    def is_fitted(self) -> bool:
        return bool(self._models)

    def unfitted_copy(self) -> QuantileBoostingPredictor:
        return QuantileBoostingPredictor(
            levels=self.levels, max_iter=self.max_iter, learning_rate=self.learning_rate,
            min_records=self.min_records, seed=self.seed,
        )

    def fit(self, records: Sequence[DurationRecord]) -> None:
        """Trains on the records; with fewer than `min_records` it is left unfitted. Nothing
        changes if training raises."""
        from sklearn.ensemble import HistGradientBoostingRegressor

        if len(records) < self.min_records:
            self._models = []
            return
        trained = self.unfitted_copy()
        trained._tool_codes = _vocabulary(r.features.tool_name for r in records)
        trained._command_codes = _vocabulary(_command(r.features.tool_name) for r in records)
        matrix = trained.feature_matrix([r.features for r in records])
        durations_s = np.array([r.duration_s for r in records], dtype=float)
        targets = np.log(np.clip(np.nan_to_num(durations_s), 0.0, MAX_OBSERVED_S) + _LOG_OFFSET_S)
        models = [
            HistGradientBoostingRegressor(
                loss="quantile", quantile=level, max_iter=self.max_iter,
                learning_rate=self.learning_rate, random_state=self.seed,
            ).fit(matrix, targets)
            for level in self.levels
        ]
        self._tool_codes, self._command_codes = trained._tool_codes, trained._command_codes
        self._models = models

    def predict_quantiles(self, features: Sequence[CallFeatures]) -> np.ndarray:
        """Predicted duration quantiles in seconds, shape (len(features), len(levels)),
        non-decreasing along each row."""
        matrix = self.feature_matrix(features)
        logs = np.column_stack([model.predict(matrix) for model in self._models])
        return np.maximum(np.sort(np.exp(logs) - _LOG_OFFSET_S, axis=1), 0.0)

    def predict_cdf(self, features: CallFeatures) -> DurationCDF:
        return DurationCDF.from_quantiles(self.levels, self.predict_quantiles([features])[0])

    def feature_matrix(self, features: Sequence[CallFeatures]) -> np.ndarray:
        return np.array([self._row(f) for f in features], dtype=float).reshape(
            len(features), 7
        )

    def _row(self, features: CallFeatures) -> list[float]:
        durations = [d for _, d in features.recent]
        same_tool = [d for name, d in features.recent if name == features.tool_name]
        return [
            _code(self._tool_codes, features.tool_name),
            _code(self._command_codes, _command(features.tool_name)),
            float(clamp_count(features.turn_index, MAX_JOB_TURNS)),
            math.log1p(clamp_count(features.num_context_tokens, MAX_CONTEXT_TOKENS)),
            _log(durations[-1]) if durations else _MISSING,
            _log(sum(durations[-3:]) / len(durations[-3:])) if durations else _MISSING,
            _log(same_tool[-1]) if same_tool else _MISSING,
        ]


def pinball_loss(levels: Sequence[float], predicted_s: np.ndarray, actual_s: np.ndarray) -> float:
    """The mean quantile (pinball) loss in seconds over calls and levels; `predicted_s` has
    one row per call and one column per level."""
    errors = np.asarray(actual_s, dtype=float)[:, None] - np.asarray(predicted_s, dtype=float)
    weights = np.asarray(levels, dtype=float)[None, :]
    return float(np.mean(np.maximum(weights * errors, (weights - 1) * errors)))


def _command(tool_name: str | None) -> str | None:
    return None if not tool_name else tool_name.split()[0]


def _vocabulary(names: object) -> dict[str, int]:
    counts = Counter(name for name in names if name is not None)  # type: ignore[union-attr]
    return {name: code for code, (name, _) in enumerate(counts.most_common(_MAX_TOOLS))}


def _code(codes: dict[str, int], name: str | None) -> float:
    code = None if name is None else codes.get(name)
    return _MISSING if code is None else float(code)


def _log(duration_s: float) -> float:
    """The log feature of a duration, clamped like every observed one (NaN counts as 0)."""
    return math.log((clamp_seconds(duration_s) or 0.0) + _LOG_OFFSET_S)
