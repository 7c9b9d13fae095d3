"""The core's `EngineStats` and the server's body budget as Prometheus series: what a scrape
of `/metrics` renders, parsed back with Prometheus' own text parser."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.core.wire import EngineStats
from engine.entrypoints.openai.body_budget import BodyByteBudget
from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.metrics import PrometheusMetrics
from engine.entrypoints.openai.refusal_pacing import RefusalPacer


def _stats(**fields: object) -> EngineStats:
    values: dict[str, object] = {
        "num_running": 1, "num_waiting": 0, "num_kv_blocks": 64, "num_free_blocks": 60,
        "kv_usage": 4 / 64, "num_pins": 0, "num_pinned_blocks": 0, "num_preemptions": 0,
        "prefix_cache_query_tokens": 400, "prefix_cache_hit_tokens": 160, "num_steps": 10,
        "step_time_s": 0.5, "execute_time_s": 0.4,
    }
    values.update(fields)
    return EngineStats(**values)  # type: ignore[arg-type]


def _samples(stats: EngineStats) -> dict[str, tuple[str, float]]:
    """Each sample of the core's series after a scrape: name -> (family type, value)."""
    metrics = PrometheusMetrics("tiny")
    metrics.update_core_stats(stats)
    samples = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.labels == {"model_name": "tiny"}:
                samples[sample.name] = (family.type, sample.value)
    return samples


def test_host_tier_series_come_from_the_engine_stats() -> None:
    samples = _samples(_stats(
        num_host_kv_blocks=256, num_used_host_kv_blocks=40, host_kv_stored_tokens=720,
        host_kv_loaded_tokens=96, prefix_cache_host_hit_tokens=96,
    ))
    assert samples["continuum:host_kv_cache_total_blocks"] == ("gauge", 256)
    assert samples["continuum:host_kv_cache_used_blocks"] == ("gauge", 40)
    assert samples["continuum:host_kv_cache_stored_tokens_total"] == ("counter", 720)
    assert samples["continuum:host_kv_cache_loaded_tokens_total"] == ("counter", 96)
    assert samples["continuum:prefix_cache_host_hits_total"] == ("counter", 96)
    assert samples["continuum:prefix_cache_hits_total"] == ("counter", 160)  # both tiers


def test_without_a_host_tier_its_series_read_zero() -> None:
    samples = _samples(_stats())
    for name in ("host_kv_cache_total_blocks", "host_kv_cache_used_blocks",
                 "host_kv_cache_stored_tokens_total", "host_kv_cache_loaded_tokens_total",
                 "prefix_cache_host_hits_total"):
        assert samples["continuum:" + name][1] == 0, name
    assert samples["continuum:kv_cache_total_blocks"] == ("gauge", 64)


def test_preemptions_and_recomputed_tokens_are_counters_of_the_engine_stats() -> None:
    samples = _samples(_stats(num_preemptions=3, recomputed_tokens=1_250))
    assert samples["continuum:num_preemptions_total"] == ("counter", 3)
    assert samples["continuum:recomputed_tokens_total"] == ("counter", 1_250)


def test_no_core_series_before_the_first_snapshot() -> None:
    text = PrometheusMetrics("tiny").render().decode()
    assert "continuum:request_success" in text
    assert "host_kv_cache" not in text and "prefix_cache_hits" not in text


def test_the_body_budget_is_read_at_each_scrape() -> None:
    metrics = PrometheusMetrics("tiny")
    budget = BodyByteBudget.for_tenants(3, 1000, 100)
    pacer = RefusalPacer(1.0, clock=lambda: 0.0, sleep=lambda _: asyncio.sleep(0))
    metrics.track_body_budget(budget, pacer)
    for _ in range(3):  # the second and third come at once after the first: late
        asyncio.run(pacer.pace("c"))
    budget.reserve("a", 500)
    budget.reserve("b", 400)
    for tenant, num_bytes in (("a", 1), ("c", 101), ("c", 200)):
        with pytest.raises(APIError):
            budget.reserve(tenant, num_bytes)
    samples = {(sample.name, sample.labels.get("status")): sample.value
               for family in text_string_to_metric_families(metrics.render().decode())
               for sample in family.samples}
    assert samples[("continuum:request_body_bytes_held", None)] == 900
    assert samples[("continuum:request_bodies_refused_total", "429")] == 1
    assert samples[("continuum:request_bodies_refused_total", "503")] == 2
    assert samples[("continuum:request_body_refusals_paced_total", None)] == 2
