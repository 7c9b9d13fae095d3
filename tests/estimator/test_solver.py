"""Eq. 2's solver against hand-computed cases, and the cold-start closed form."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from estimator.solver import (
    DurationCDF,
    cold_start_ttl,
    memory_price,
    pool_capacity_requests,
    solve_ttl,
    utility,
)


@pytest.mark.parametrize("samples, benefit_s, expected_ttl_s", [
    # t=1: .25*5-1 = .25; t=2: .5*5-2 = .5; t=3: .75*5-3 = .75; t=4: 5-4 = 1 -> 4.
    ([1, 2, 3, 4], 5.0, 4.0),
    # Every candidate loses (.75-1, 1.5-2, 2.25-3, 3-4): do not pin.
    ([1, 2, 3, 4], 3.0, 0.0),
    # t=.2: .5*2-.2 = .8; t=.3: .75*2-.3 = 1.2; t=10: 2-10 < 0 -> .3.
    ([0.2, 0.3, 0.2, 10.0], 2.0, 0.3),
    # t=1: .5*4-1 = 1; t=3: 1*4-3 = 1: a tie goes to the shorter pin.
    ([3, 1], 4.0, 1.0),
    # Durations of 0 are no candidate (a TTL of 0 is no pin); t=5: 3-5 < 0.
    ([0, 0, 5], 3.0, 0.0),
    ([0.5], 0.0, 0.0),
])
def test_solver_hand_computed(samples, benefit_s, expected_ttl_s) -> None:
    assert solve_ttl(DurationCDF.from_samples(samples), benefit_s) == expected_ttl_s


def test_empirical_cdf_counts_ties_once() -> None:
    cdf = DurationCDF.from_samples([2.0, 1.0, 2.0, 4.0])
    assert cdf.durations_s == (1.0, 2.0, 4.0)
    assert cdf.probabilities == (0.25, 0.75, 1.0)
    assert [cdf.probability(t) for t in (0.5, 1.0, 3.0, 9.0)] == [0.0, 0.25, 0.75, 1.0]
    assert [cdf.quantile(q) for q in (0.1, 0.5, 0.75, 1.0)] == [1.0, 2.0, 2.0, 4.0]


def test_cdf_from_crossing_quantiles_is_sorted() -> None:
    cdf = DurationCDF.from_quantiles([0.1, 0.5, 0.9], [3.0, 1.0, 2.0])
    assert cdf.durations_s == (1.0, 2.0, 3.0) and cdf.probabilities == (0.1, 0.5, 0.9)
    # Equal predictions keep the higher level; negative predictions are clipped to 0.
    assert DurationCDF.from_quantiles([0.2, 0.4], [-1.0, -2.0]).probabilities == (0.4,)


@pytest.mark.parametrize("durations, probabilities", [
    ((2.0, 1.0), (0.5, 1.0)), ((1.0, 2.0), (0.6, 0.5)), ((1.0,), (1.5,)), ((1.0,), ()),
])
def test_malformed_cdfs_are_rejected(durations, probabilities) -> None:
    with pytest.raises(ValueError):
        DurationCDF(durations, probabilities)
    with pytest.raises(ValueError):
        DurationCDF.from_samples([])


@pytest.mark.parametrize("benefit_s, expected_ttl_s", [
    (math.e**2, 2.0), (math.e, 1.0), (1.0, 0.0), (0.5, 0.0), (0.0, 0.0),
])
def test_cold_start_closed_form(benefit_s, expected_ttl_s) -> None:
    assert cold_start_ttl(benefit_s) == pytest.approx(expected_ttl_s)


@given(st.floats(min_value=1.01, max_value=1e4))
def test_cold_start_maximises_the_exponential_prior_utility(benefit_s) -> None:
    def expected(t: float) -> float:
        return (1 - math.exp(-t)) * benefit_s - t

    best = cold_start_ttl(benefit_s)
    for t in (best * 0.9, best * 1.1, best + 0.01, max(0.0, best - 0.01)):
        assert expected(best) >= expected(t) - 1e-9


@given(st.lists(st.floats(min_value=0, max_value=100), min_size=1, max_size=30),
       st.floats(min_value=0, max_value=200))
def test_solver_is_the_argmax_over_candidates(samples, benefit_s) -> None:
    cdf = DurationCDF.from_samples(samples)
    ttl_s = solve_ttl(cdf, benefit_s)
    best = max([0.0, *(utility(t, cdf, benefit_s) for t in cdf.durations_s)])
    assert utility(ttl_s, cdf, benefit_s) == pytest.approx(best)
    assert ttl_s == 0.0 or ttl_s in cdf.durations_s


def test_expected_hold_charges_a_pin_the_time_it_is_held() -> None:
    # Durations 1, 2 and 10 s, equally likely; a hit saves 5 s.
    cdf = DurationCDF.from_samples([1.0, 2.0, 10.0])
    # Charged its TTL: t = 1 gains 1/3 * 5 - 1; t = 2 gains 2/3 * 5 - 2 = 1.33 (best).
    assert solve_ttl(cdf, 5.0) == 2.0
    # Charged E[min(D, t)]: t = 2 holds 1/3 * 1 + 2/3 * 2 = 1.67 s for a 3.33 s saving
    # (gain 1.67); t = 10 holds (1 + 2 + 10) / 3 = 4.33 s for 5 s (gain 0.67).
    assert solve_ttl(cdf, 5.0, "expected-hold") == 2.0
    # With a 12 s saving, covering the 10 s call pays for itself only when a pin is charged
    # what it holds: 12 - 4.33 = 7.67 > 2/3 * 12 - 1.67 = 6.33.
    assert solve_ttl(cdf, 12.0) == 2.0
    assert solve_ttl(cdf, 12.0, "expected-hold") == 10.0
    with pytest.raises(ValueError, match="pin_cost"):
        solve_ttl(cdf, 5.0, "memory")  # type: ignore[arg-type]


def test_priced_charges_the_expected_hold_at_the_memory_price() -> None:
    cdf = DurationCDF.from_samples([1.0, 2.0, 10.0])
    # A pin of 1 % of the pool beside 20 active requests costs 0.2 s of their time a second.
    price = memory_price(pool_share=0.01, num_active_requests=20)
    assert price == pytest.approx(0.2)
    # Held E[min(D, 10)] = 4.33 s at 0.2: 0.87 s for a 5 s saving beats every shorter TTL.
    assert solve_ttl(cdf, 5.0, "priced", price=price) == 10.0
    # At a price of 1 it is expected-hold; at 0 (an idle pool) a pin covers every duration.
    assert solve_ttl(cdf, 5.0, "priced", price=1.0) == solve_ttl(cdf, 5.0, "expected-hold")
    assert solve_ttl(cdf, 0.5, "priced", price=0.0) == 10.0
    # A crowded pool prices it out.
    assert solve_ttl(cdf, 5.0, "priced", price=memory_price(0.05, 200)) == 0.0


def test_priced_capped_counts_the_requests_up_to_what_the_pool_holds() -> None:
    # 10 requests running hold 40 % of the pool: it holds 25 of their mean size.
    capacity = pool_capacity_requests(num_running_requests=10, running_pool_share=0.4)
    assert capacity == pytest.approx(25.0)
    # A pin of a fifth of the pool beside 60 active requests: 12 s a second uncapped, but its
    # blocks could hold only 5 of the running requests' size.
    assert memory_price(0.2, 60) == pytest.approx(12.0)
    assert memory_price(0.2, 60, capacity) == pytest.approx(5.0)
    assert memory_price(0.2, 10, capacity) == pytest.approx(2.0)  # fewer active than fit
    assert memory_price(0.2, 60, None) == memory_price(0.2, 60)
    # Nothing running, or a share that says nothing: no mean size, so no bound.
    for share in (0.0, -0.1, math.nan, math.inf):
        assert pool_capacity_requests(3, share) is None
    assert pool_capacity_requests(0, 0.4) is None
    assert memory_price(0.2, 60, math.nan) == memory_price(0.2, 60)
    # A tiny share bounds nothing; shares over the pool (shared prefixes counted once per
    # request) never bound the count below the requests that run now.
    assert memory_price(0.2, 60, pool_capacity_requests(3, 1e-320)) == memory_price(0.2, 60)
    assert pool_capacity_requests(10, 1.5) == 10.0
    cdf = DurationCDF.from_samples([1.0, 2.0, 10.0])
    assert solve_ttl(cdf, 5.0, "priced-capped", price=0.2) == solve_ttl(cdf, 5.0, "priced",
                                                                        price=0.2)
