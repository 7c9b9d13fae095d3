"""The time to rebuild a turn's context: a quadratic fit of prefill seconds against length.

Prefill cost grows linearly with the context (weights, MLPs) plus quadratically (attention).
The engine measures a few prefills at start-up, or a profile file supplies them; the fit is a
non-negative least-squares regression (SciPy's `nnls`) of seconds on `[n, n^2]`: what a
rebuild costs an idle engine (Eq. 2 scales it by the requests running, see `estimator.eq2`).
With a host KV tier, a context held there is reloaded instead
(`HostReloadCost`, the same fit of timed loads).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from estimator.ttl_estimator import MAX_CONTEXT_TOKENS, clamp_count

# Feature scale: contexts are thousands of tokens, and n^2 in raw tokens makes the
# least-squares problem badly conditioned.
_TOKENS_PER_UNIT = 1000.0

# A prefill cost model is implausible if a context of PLAUSIBILITY_CONTEXT_TOKENS tokens would
# take more than MAX_PLAUSIBLE_PREFILL_S seconds (about 30 years): a saved state holding one is
# refused. A 405B-parameter model on a slow accelerator stays some hundred times below it.
PLAUSIBILITY_CONTEXT_TOKENS = 10_000_000
MAX_PLAUSIBLE_PREFILL_S = 1e9


@dataclass(frozen=True, slots=True)
class PrefillCostModel:
    """`cost_s(n) = intercept_s + linear_s * (n / 1000) + quadratic_s * (n / 1000)^2`,
    every coefficient >= 0."""

    intercept_s: float = 0.0
    linear_s: float = 0.0
    quadratic_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("intercept_s", "linear_s", "quadratic_s"):
            value = getattr(self, name)
            if not (value >= 0 and value != float("inf")):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    def cost_s(self, num_tokens: int) -> float:
        """Seconds to prefill a context of `num_tokens` tokens from scratch (counted up to
        `MAX_CONTEXT_TOKENS`); never raises, but may be infinite for huge coefficients (see
        `check_plausible`)."""
        units = clamp_count(num_tokens, MAX_CONTEXT_TOKENS) / _TOKENS_PER_UNIT
        return self.intercept_s + units * (self.linear_s + units * self.quadratic_s)

    def check_plausible(self) -> None:
        """ValueError if prefilling `PLAUSIBILITY_CONTEXT_TOKENS` tokens would take longer than
        `MAX_PLAUSIBLE_PREFILL_S` seconds (or forever)."""
        long_s = self.cost_s(PLAUSIBILITY_CONTEXT_TOKENS)
        if not long_s <= MAX_PLAUSIBLE_PREFILL_S:
            raise ValueError(
                f"implausible prefill cost: {long_s!r} s for {PLAUSIBILITY_CONTEXT_TOKENS} "
                f"tokens (at most {MAX_PLAUSIBLE_PREFILL_S} s)"
            )

    @classmethod
    def fit(cls, points: Sequence[tuple[int, float]]) -> PrefillCostModel:
        """Fits (num_tokens, seconds) measurements; ValueError if there are fewer than two
        distinct lengths or a value is negative or not finite.

        The least squares of scikit-learn's `LinearRegression(positive=True)`, solved with
        the SciPy routine it calls (`scipy.optimize.nnls`) on the features and seconds
        centred by their means: importing scikit-learn took 1.35 s of a server's start on
        this project's CPU machine, SciPy's solver 0.55 s.
        """
        import numpy as np
        from scipy.optimize import nnls

        if len({int(n) for n, _ in points}) < 2:
            raise ValueError("a prefill profile needs at least two distinct lengths")
        if any(n < 0 or not 0 <= s < math.inf for n, s in points):
            raise ValueError("prefill profile points must be (tokens >= 0, finite seconds >= 0)")
        units = np.array([n / _TOKENS_PER_UNIT for n, _ in points])
        features = np.stack([units, units * units], axis=1)
        seconds = np.array([float(s) for _, s in points])
        feature_means, seconds_mean = features.mean(axis=0), seconds.mean()
        coefficients = nnls(features - feature_means, seconds - seconds_mean)[0]
        intercept = float(seconds_mean - feature_means @ coefficients)
        if intercept < 0:
            # The intercept is not sign-constrained; refit through the origin instead.
            coefficients = nnls(features, seconds)[0]
            intercept = 0.0
        linear, quadratic = (float(c) for c in coefficients)
        return cls(intercept, linear, quadratic)

    def to_dict(self) -> dict[str, float]:
        return {"intercept_s": self.intercept_s, "linear_s": self.linear_s,
                "quadratic_s": self.quadratic_s}

    @classmethod
    def from_dict(cls, data: object) -> PrefillCostModel:
        if not isinstance(data, dict):
            raise ValueError("a prefill cost model must be a JSON object")
        try:
            return cls(**{key: float(data[key])
                          for key in ("intercept_s", "linear_s", "quadratic_s")})
        except (KeyError, TypeError, OverflowError) as error:
            raise ValueError(f"bad prefill cost model: {error}") from error


@dataclass(frozen=True, slots=True)
class HostReloadCost:
    """Seconds to load a context's KV back from the engine's host tier: `model` is fitted on
    loads timed at start-up, as prefills are (`PrefillCostModel.fit`: loads grow linearly
    with the bytes, so its quadratic term comes out near 0); `max_tokens` is what the tier
    holds (its blocks times the block size), beyond which a context cannot be reloaded."""

    model: PrefillCostModel
    max_tokens: int

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens!r}")

    def cost_s(self, num_tokens: int) -> float | None:
        """Seconds to reload a context of `num_tokens` tokens; None if it is larger than
        the tier (it must be prefilled)."""
        return self.model.cost_s(num_tokens) if num_tokens <= self.max_tokens else None


def read_prefill_profile(path: str | Path) -> list[tuple[int, float]]:
    """Reads a profile file: `{"points": [[num_tokens, seconds], ...]}` (or the bare list).

    ValueError if the file is not such a profile.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read prefill profile {path}: {error}") from error
    raw = data.get("points") if isinstance(data, dict) else data
    if not isinstance(raw, list):
        raise ValueError(f"{path}: expected a list of [num_tokens, seconds] points")
    points: list[tuple[int, float]] = []
    for item in raw:
        if not (isinstance(item, list | tuple) and len(item) == 2):
            raise ValueError(f"{path}: bad point {item!r}")
        num_tokens, seconds = item
        if not isinstance(num_tokens, int) or not isinstance(seconds, int | float):
            raise ValueError(f"{path}: bad point {item!r}")
        points.append((num_tokens, float(seconds)))
    return points


def roofline_prefill_model(
    *, num_params: float, flops_per_token_pair: float, peak_flops: float, efficiency: float,
    overhead_s: float = 0.0,
) -> PrefillCostModel:
    """A prefill cost from a model's shape and a device's FLOP/s: `2 * num_params` FLOPs per
    token, `flops_per_token_pair` for each (query, earlier key) pair of causal attention."""
    flops_per_s = peak_flops * efficiency
    return PrefillCostModel(
        intercept_s=overhead_s,
        linear_s=2.0 * num_params * _TOKENS_PER_UNIT / flops_per_s,
        quadratic_s=flops_per_token_pair * _TOKENS_PER_UNIT**2 / 2.0 / flops_per_s,
    )


# Llama-3.1-8B on one H100 (989 TFLOP/s dense BF16) at 50 % efficiency: 8.0e9 parameters;
# attention costs 4 * layers * hidden = 4 * 32 * 4096 FLOPs per (query, key) pair.
H100_LLAMA_8B_PREFILL = roofline_prefill_model(
    num_params=8.0e9, flops_per_token_pair=4 * 32 * 4096, peak_flops=989e12, efficiency=0.5,
    overhead_s=0.01,
)
