"""The prefill cost model: a non-negative quadratic fit of prefill seconds on length."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from sklearn.linear_model import LinearRegression

from estimator.cost_model import (
    H100_LLAMA_8B_PREFILL,
    PrefillCostModel,
    read_prefill_profile,
)
from estimator.ttl_estimator import MAX_CONTEXT_TOKENS


def test_fit_recovers_a_quadratic() -> None:
    truth = PrefillCostModel(intercept_s=0.01, linear_s=0.05, quadratic_s=0.002)
    points = [(n, truth.cost_s(n)) for n in (16, 256, 1024, 4096, 16384)]
    fitted = PrefillCostModel.fit(points)
    for n in (100, 2000, 30000):
        assert fitted.cost_s(n) == pytest.approx(truth.cost_s(n), rel=1e-6)


def test_fit_keeps_every_coefficient_non_negative() -> None:
    # Noisy, slightly decreasing timings must not give negative costs at any length.
    fitted = PrefillCostModel.fit([(16, 0.010), (64, 0.009), (256, 0.011), (1024, 0.030)])
    assert min(fitted.intercept_s, fitted.linear_s, fitted.quadratic_s) >= 0
    assert all(fitted.cost_s(n) >= 0 for n in (0, 10, 10_000))


def scikit_learn_fit(points: list[tuple[int, float]]) -> PrefillCostModel:
    """The fit as scikit-learn computes it, through the origin when the intercept is < 0."""
    features = [[n / 1000, (n / 1000) ** 2] for n, _ in points]
    seconds = [s for _, s in points]
    regression = LinearRegression(positive=True).fit(features, seconds)
    if regression.intercept_ < 0:
        regression = LinearRegression(positive=True, fit_intercept=False).fit(features, seconds)
    return PrefillCostModel(max(float(regression.intercept_), 0.0), *map(float, regression.coef_))


@pytest.mark.parametrize("seed", range(8))
def test_fit_is_scikit_learns_non_negative_least_squares(seed: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 8192, size=int(rng.integers(2, 12)))
    lengths[1] = lengths[0] + 1  # two distinct lengths at least
    # Noisy profiles: some need a zero coefficient, some a zero (refitted) intercept.
    truth = rng.uniform(-0.02, 0.05, size=3)
    points = [(int(n), max(0.0, float(truth[0] + truth[1] * n / 1000 + truth[2] * (n / 1000) ** 2
                                      + rng.normal(0, 0.01))))
              for n in lengths]
    fitted, expected = PrefillCostModel.fit(points), scikit_learn_fit(points)
    for name in ("intercept_s", "linear_s", "quadratic_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(expected, name), rel=1e-6,
                                                      abs=1e-9)


@pytest.mark.parametrize("points", [[(16, 0.1)], [(16, 0.1), (16, 0.2)], [(16, -1.0), (32, 1)],
                                    [(16, 0.1), (32, math.inf)], [(16, 0.1), (32, math.nan)]])
def test_fit_rejects_unusable_profiles(points) -> None:
    with pytest.raises(ValueError):
        PrefillCostModel.fit(points)


def test_profile_files_and_round_trip(tmp_path) -> None:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"points": [[16, 0.001], [1024, 0.02]]}))
    assert read_prefill_profile(path) == [(16, 0.001), (1024, 0.02)]
    path.write_text(json.dumps([[16, 0.001], [1024, 0.02]]))
    assert read_prefill_profile(path) == [(16, 0.001), (1024, 0.02)]
    for bad in ("{", '{"points": 3}', '[[1, 2, 3]]', '[["a", 1]]'):
        path.write_text(bad)
        with pytest.raises(ValueError):
            read_prefill_profile(path)
    with pytest.raises(ValueError):
        read_prefill_profile(tmp_path / "missing.json")
    model = PrefillCostModel(0.5, 1.0, 2.0)
    assert PrefillCostModel.from_dict(model.to_dict()) == model
    with pytest.raises(ValueError):
        PrefillCostModel.from_dict({"intercept_s": -1, "linear_s": 0, "quadratic_s": 0})


def test_the_roofline_default_is_plausible_for_an_8b_model_on_an_h100() -> None:
    # About 30k tokens/s at short contexts; attention makes 32k tokens cost well over 1 s.
    assert 0.02 < H100_LLAMA_8B_PREFILL.cost_s(1000) < 0.1
    assert 1.0 < H100_LLAMA_8B_PREFILL.cost_s(32_000) < 3.0


def test_costs_never_raise_for_huge_contexts() -> None:
    model = PrefillCostModel(0.0, 1.0, 1.0)
    assert model.cost_s(10**400) == model.cost_s(MAX_CONTEXT_TOKENS)  # counted up to a bound
    assert math.isfinite(model.cost_s(10**400)) and model.cost_s(-5) == 0.0
    assert PrefillCostModel(0.0, 1e308, 1e308).cost_s(10**6) == math.inf  # no OverflowError


@pytest.mark.parametrize("model, plausible", [
    (H100_LLAMA_8B_PREFILL, True),
    (PrefillCostModel(quadratic_s=10.0), True),  # 1e9 s at 10M tokens: the limit
    (PrefillCostModel(quadratic_s=10.1), False),
    (PrefillCostModel(linear_s=1e300), False),
    (PrefillCostModel(1e308, 1e308, 1e308), False),  # infinite: an endless pin
])
def test_implausible_costs_are_named(model, plausible) -> None:
    if plausible:
        model.check_plausible()
    else:
        with pytest.raises(ValueError, match="implausible prefill cost"):
            model.check_plausible()


def test_a_cost_model_from_data_rejects_numbers_beyond_floats() -> None:
    with pytest.raises(ValueError):
        PrefillCostModel.from_dict({"intercept_s": 10**400, "linear_s": 0, "quadratic_s": 0})
    with pytest.raises(ValueError):
        PrefillCostModel.from_dict({"intercept_s": 1e400, "linear_s": 0, "quadratic_s": 0})
