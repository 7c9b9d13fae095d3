"""The cost-benefit TTL rule of the Continuum paper (Eq. 2), over a duration distribution.

Pinning a finished turn's KV for `t` seconds costs memory for a while and, if the job's next
turn arrives within `t`, saves `benefit_s`: the queueing delay the turn would otherwise
suffer (`T * eta`) plus the time to rebuild its context (`R`). With `P` the CDF of the tool's
duration `D`, the TTL is `argmax over t in {0} and the candidates of P(t) * benefit_s - C(t)`.

`C(t)`, the seconds of memory a pin is charged, is the paper's `t` (`pin_cost="ttl"`), or,
as an option, the time the pin is expected to be held, `E[min(D, t)]`
(`pin_cost="expected-hold"`): the engine releases a pin as soon as the next turn is admitted,
so a pin that is used holds memory only for the tool's duration. `pin_cost="priced"` charges
that expected hold at a price (`memory_price`): the share of the pool the pin holds times the
requests running and waiting; `"priced-capped"` counts those requests up to as many as the
whole pool holds at the running requests' mean size (`pool_capacity_requests`): the price is
then at most the number of such requests the pin's own blocks could hold, which is as many as
the memory it keeps from others could run (and nothing while no request waits:
`Eq2Estimator.memory_price`).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

PinCost = Literal["ttl", "expected-hold", "priced", "priced-capped"]
PIN_COSTS: tuple[PinCost, ...] = ("ttl", "expected-hold", "priced", "priced-capped")
PRICED_PIN_COSTS: tuple[PinCost, ...] = ("priced", "priced-capped")


@dataclass(frozen=True, slots=True)
class DurationCDF:
    """A step CDF: `probabilities[i]` is P(duration <= `durations_s[i]`).

    `durations_s` is strictly increasing and `probabilities` non-decreasing in [0, 1]. Built
    from samples (`from_samples`) or from predicted quantiles (`from_quantiles`).
    """

    durations_s: tuple[float, ...]
    probabilities: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.durations_s) != len(self.probabilities):
            raise ValueError("durations_s and probabilities differ in length")
        if any(b <= a for a, b in zip(self.durations_s, self.durations_s[1:], strict=False)):
            raise ValueError("durations_s must be strictly increasing")
        if any(not 0.0 <= p <= 1.0 for p in self.probabilities) or any(
            b < a for a, b in zip(self.probabilities, self.probabilities[1:], strict=False)
        ):
            raise ValueError("probabilities must be non-decreasing within [0, 1]")

    @classmethod
    def from_samples(cls, samples_s: Sequence[float]) -> DurationCDF:
        """The empirical CDF of observed durations (seconds, >= 0)."""
        if not samples_s:
            raise ValueError("an empirical CDF needs at least one sample")
        ordered = sorted(samples_s)
        durations: list[float] = []
        probabilities: list[float] = []
        for index, value in enumerate(ordered):
            if durations and value == durations[-1]:
                probabilities[-1] = (index + 1) / len(ordered)
            else:
                durations.append(value)
                probabilities.append((index + 1) / len(ordered))
        return cls(tuple(durations), tuple(probabilities))

    @classmethod
    def from_quantiles(cls, levels: Sequence[float], values_s: Sequence[float]) -> DurationCDF:
        """A CDF through predicted quantiles: P(`values_s[i]`) = `levels[i]`. Crossing
        quantiles are rearranged (values sorted apart from levels); equal values keep the
        highest level."""
        if len(levels) != len(values_s) or not levels:
            raise ValueError("levels and values_s must be non-empty and of equal length")
        pairs = zip(sorted(max(0.0, v) for v in values_s), sorted(levels), strict=True)
        durations: list[float] = []
        probabilities: list[float] = []
        for value, level in pairs:
            if durations and value == durations[-1]:
                probabilities[-1] = level
            else:
                durations.append(value)
                probabilities.append(level)
        return cls(tuple(durations), tuple(probabilities))

    def probability(self, duration_s: float) -> float:
        """P(duration <= `duration_s`)."""
        index = bisect_right(self.durations_s, duration_s)
        return self.probabilities[index - 1] if index > 0 else 0.0

    def quantile(self, level: float) -> float:
        """The smallest duration whose probability reaches `level` (the largest if none)."""
        for duration, probability in zip(self.durations_s, self.probabilities, strict=True):
            if probability >= level:
                return duration
        return self.durations_s[-1]


def utility(ttl_s: float, cdf: DurationCDF, benefit_s: float) -> float:
    """Eq. 2's expected saving of pinning for `ttl_s`; 0 for no pin."""
    return 0.0 if ttl_s <= 0 else cdf.probability(ttl_s) * benefit_s - ttl_s


def memory_price(pool_share: float, num_active_requests: int,
                 max_delayed_requests: float | None = None) -> float:
    """Seconds of delay a pin causes other requests per second it holds memory: the share of
    the KV pool it holds (which a full pool would otherwise give to other work) times the
    requests running or waiting beside it, all of which that memory would speed up, counted
    up to `max_delayed_requests` (None or NaN: no bound; see `pool_capacity_requests`)."""
    count = float(max(0, num_active_requests))
    if max_delayed_requests is not None and not math.isnan(max_delayed_requests):
        count = min(count, max(0.0, max_delayed_requests))
    return max(0.0, pool_share) * count


def pool_capacity_requests(num_running_requests: int, running_pool_share: float) -> float | None:
    """How many requests of the running requests' mean size the whole KV pool holds at once
    (`num_running_requests` holding `running_pool_share` of it), the bound of
    `pin_cost="priced-capped"`: a pin's share of the pool times this is how many such requests
    its blocks could hold, and no more can run sooner for the memory it frees each second.
    Never fewer than `num_running_requests`, which the pool holds now (their shares count
    prefix blocks they share once each, so together they may exceed the pool). None when
    nothing runs or the share is not a positive finite number (no size to go by)."""
    if num_running_requests <= 0 or not (0 < running_pool_share < math.inf):
        return None
    return max(float(num_running_requests), num_running_requests / running_pool_share)


def solve_ttl(cdf: DurationCDF, benefit_s: float, pin_cost: PinCost = "ttl",
              price: float = 1.0) -> float:
    """Eq. 2's TTL: the candidate duration with the highest expected saving, 0 (no pin) unless
    one is strictly positive; the shortest of equal maxima (less memory held). `pin_cost`
    says how a pin is charged and `price` what a second of it costs with `priced` or
    `priced-capped` (see the module docstring)."""
    if pin_cost not in PIN_COSTS:
        raise ValueError(f"pin_cost must be one of {PIN_COSTS}, got {pin_cost!r}")
    best_ttl_s, best_utility = 0.0, 0.0
    held_s, hit, previous_s, previous_probability = 0.0, 0.0, 0.0, 0.0
    for duration_s, probability in zip(cdf.durations_s, cdf.probabilities, strict=True):
        # E[min(D, t)] = the integral from 0 to t of P(D > s) ds, over the step CDF.
        held_s += (1.0 - previous_probability) * (duration_s - previous_s)
        hit += probability - previous_probability
        previous_s, previous_probability = duration_s, probability
        cost_s = duration_s if pin_cost == "ttl" else held_s
        if pin_cost in PRICED_PIN_COSTS:
            cost_s *= price
        gain = hit * benefit_s - cost_s
        if duration_s > 0 and gain > best_utility:
            best_ttl_s, best_utility = duration_s, gain
    return best_ttl_s


def cold_start_ttl(benefit_s: float) -> float:
    """Eq. 2 under the cold-start prior, durations ~ Exp(mean 1 s): maximising
    `(1 - exp(-t)) * B - t` gives `t = ln B` when `B > 1`, else no pin. Memory pressure
    taking pins at a rate (see `solve_ttl`) leaves it unchanged: the saving becomes
    `B (1 - exp(-(1 + rate) t)) / (1 + rate)` and the held time `(1 - exp(-rate t)) / rate`,
    whose derivatives still meet at `exp(-t) = 1 / B`."""
    return math.log(benefit_s) if benefit_s > 1.0 else 0.0
