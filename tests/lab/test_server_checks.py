"""The checks run on a server after a load: the engine's end state and the memory bound."""

from __future__ import annotations

from dataclasses import replace

from lab.server_checks import EngineEndState, MemoryFigures, passed


def _end_state(**overrides: int | bool) -> EngineEndState:
    values: dict[str, int | bool] = {
        "idle": True, "num_running": 0, "num_waiting": 0, "total_blocks": 64,
        "free_blocks": 64, "num_pins": 0, "pinned_blocks": 0, "num_jobs": 0, **overrides}
    return EngineEndState(**values)  # type: ignore[arg-type]


def test_end_state_checks_fail_on_leaks_pins_and_jobs() -> None:
    assert passed(_end_state().checks())
    metrics = {"continuum:kv_cache_total_blocks": 64.0, "continuum:kv_cache_free_blocks": 60.0,
               "continuum:num_pins": 1.0, "continuum:pinned_blocks": 4.0}
    state = EngineEndState.from_metrics(metrics, idle=True)
    assert state.leaked_blocks == 4
    failed = {check.name for check in state.checks() if not check.passed}
    assert failed == {"no leaked KV blocks", "no pins left"}
    assert not passed(_end_state(num_jobs=1).checks())
    assert not passed(_end_state(idle=False, num_running=2).checks())
    # A server that exposes no pool at all must not pass as leak-free.
    assert not passed(EngineEndState.from_metrics({}, idle=True).checks())


def test_memory_check_against_the_bound() -> None:
    memory = MemoryFigures(start_rss_mib=500.0, baseline_rss_mib=600.0, end_rss_mib=664.0,
                           peak_rss_mib=700.0, bound_mib=64.0)
    assert memory.growth_mib == 64.0 and memory.check().passed
    grown = replace(memory, end_rss_mib=664.5)
    assert not grown.check().passed and "+64.5 MiB" in grown.check().detail
    assert memory.to_dict()["growth_mib"] == 64.0
