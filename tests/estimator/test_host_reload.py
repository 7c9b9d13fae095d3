"""Eq. 2's R with a host KV tier: the reload time for a context the tier can hold, the prefill
time otherwise, and state files from before the tier still load."""

from __future__ import annotations

import json

import pytest

from estimator.cost_model import HostReloadCost, PrefillCostModel
from estimator.eq2 import Eq2Estimator
from estimator.estimator_registry import EstimatorSettings, make_estimator
from estimator.state_file import load_state_or_cold_start, save_state
from estimator.ttl_estimator import ToolCall

PREFILL = PrefillCostModel(intercept_s=0.5, linear_s=2.0)  # 0.5 s + 2 s per 1000 tokens
RELOAD = HostReloadCost(PrefillCostModel(linear_s=0.1), max_tokens=4096)  # 0.1 s per 1000

# A state file as the estimator wrote it before the host tier existed.
STATE_BEFORE_THE_TIER = {
    "version": 1, "cold_start_samples": 100, "pooled_s": [0.5, 1.5], "tools_s": {"ls": [0.5]},
    "queueing_delays_s": [2.0], "job_num_turns": [3], "records": [],
    "prefill_cost": {"intercept_s": 0.25, "linear_s": 1.0, "quadratic_s": 0.0},
}


def call(tokens: int, running: int = 0) -> ToolCall:
    return ToolCall("j", "ls", 0.0, tokens, 0, running)


def test_a_reload_cost_prices_contexts_up_to_the_tiers_size_only() -> None:
    assert RELOAD.cost_s(2000) == pytest.approx(0.2)
    assert RELOAD.cost_s(4096) == pytest.approx(0.4096)
    assert RELOAD.cost_s(4097) is None
    with pytest.raises(ValueError, match="max_tokens"):
        HostReloadCost(PREFILL, max_tokens=-1)


def test_r_is_the_reload_time_when_the_tier_holds_the_context_else_the_prefill_time() -> None:
    estimator = Eq2Estimator(prefill_cost=PREFILL, reload_cost=RELOAD)
    assert estimator.rebuild_s(2000) == pytest.approx(0.2)
    assert estimator.rebuild_s(5000) == pytest.approx(10.5)
    decision = estimator.decide(call(2000))
    assert decision.rebuild_s == pytest.approx(0.2)
    assert decision.benefit_s == pytest.approx(0.2)  # T = 0: R alone
    no_tier = Eq2Estimator(prefill_cost=PREFILL)
    assert no_tier.decide(call(2000)).rebuild_s == pytest.approx(4.5)


def test_the_running_requests_multiply_a_reload_as_they_do_a_prefill() -> None:
    estimator = Eq2Estimator(prefill_cost=PREFILL, reload_cost=RELOAD,
                             rebuild_cost="prefill-times-running")
    assert estimator.decide(call(2000, running=3)).rebuild_s == pytest.approx(0.8)


def test_a_cheaper_rebuild_shortens_the_cold_start_ttl() -> None:
    estimator = Eq2Estimator(prefill_cost=PREFILL, reload_cost=RELOAD)
    estimator.observe_queueing_delay(3.0)
    with_tier = estimator.decide(call(2000))
    without = Eq2Estimator(prefill_cost=PREFILL)
    without.observe_queueing_delay(3.0)
    assert 0 < with_tier.ttl_s < without.decide(call(2000)).ttl_s


def test_the_registry_passes_the_reload_cost_to_eq2() -> None:
    settings = EstimatorSettings(prefill_cost=PREFILL, reload_cost=RELOAD)
    for name in ("eq2-empirical", "eq2-learned"):
        estimator = make_estimator(name, settings)
        assert isinstance(estimator, Eq2Estimator) and estimator.reload_cost is RELOAD


def test_a_state_file_from_before_the_tier_loads_and_the_reload_cost_stays(tmp_path) -> None:
    path = tmp_path / "state.json"
    path.write_text(json.dumps(STATE_BEFORE_THE_TIER))
    estimator = Eq2Estimator(reload_cost=RELOAD)
    assert load_state_or_cold_start(estimator, path)
    assert estimator.prefill_cost == PrefillCostModel(0.25, 1.0, 0.0)  # the state's
    assert estimator.reload_cost is RELOAD
    assert estimator.rebuild_s(1000) == pytest.approx(0.1)
    assert estimator.rebuild_s(10_000) == pytest.approx(10.25)


def test_the_saved_state_keeps_its_format_and_loads_without_a_tier(tmp_path) -> None:
    path = tmp_path / "state.json"
    estimator = Eq2Estimator(prefill_cost=PREFILL, reload_cost=RELOAD)
    estimator.load_state(STATE_BEFORE_THE_TIER)
    assert save_state(estimator, path)
    saved = json.loads(path.read_text())
    # The reload cost is not saved; the file is marked as a state.
    assert saved.keys() == {"format", *STATE_BEFORE_THE_TIER}
    restarted = Eq2Estimator()
    assert load_state_or_cold_start(restarted, path)
    assert restarted.reload_cost is None and restarted.prefill_cost == PREFILL
    assert restarted.rebuild_s(1000) == pytest.approx(2.5)
