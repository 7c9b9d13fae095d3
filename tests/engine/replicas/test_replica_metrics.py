"""Merging the replicas' Prometheus expositions into one."""

from __future__ import annotations

from prometheus_client.metrics_core import CounterMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from engine.replicas.replica_metrics import merge_replicas, render, routing_decisions

REPLICA_TEXT = """# HELP continuum:num_preemptions_total Requests preempted.
# TYPE continuum:num_preemptions_total counter
continuum:num_preemptions_total{{model_name="tiny"}} {preemptions}
# HELP continuum:kv_usage KV in use.
# TYPE continuum:kv_usage gauge
continuum:kv_usage{{model_name="tiny"}} 0.5
"""


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text.decode())
            for sample in family.samples}


def test_every_replicas_series_is_labelled_with_its_replica() -> None:
    text = merge_replicas(
        {"r1": REPLICA_TEXT.format(preemptions=2) + render([routing_decisions({"affinity": 3})])
         .decode(), "r2": REPLICA_TEXT.format(preemptions=5)},
        [CounterMetricFamily("continuum:replica_retries", "Retries.", value=1)])
    merged = samples(text)
    model = ("model_name", "tiny")
    assert merged[("continuum:num_preemptions_total", (model, ("replica", "r1")))] == 2
    assert merged[("continuum:num_preemptions_total", (model, ("replica", "r2")))] == 5
    assert merged[("continuum:kv_usage", (model, ("replica", "r2")))] == 0.5
    assert merged[("continuum:routing_decisions_total",
                   (("kind", "affinity"), ("replica", "r1")))] == 3
    assert merged[("continuum:replica_retries_total", ())] == 1
    assert text.count(b"# TYPE continuum:num_preemptions_total counter") == 1
