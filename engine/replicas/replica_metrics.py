"""Prometheus text of a replicated server: every replica's series, labelled by replica, in one
exposition, with the routing decisions each replica received and the ingress's own counters."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

REPLICA_LABEL = "replica"


def routing_decisions(counts: Mapping[str, int]) -> CounterMetricFamily:
    """The routing decisions a replica received, by kind (`engine.replicas.routing`)."""
    family = CounterMetricFamily(
        "continuum:routing_decisions",
        "Requests routed to this replica, by the reason it was chosen (affinity: its job's "
        "replica; placed: a new job; rerouted: its job's replica was gone; moved: its job's "
        "replica was over the load bound; spread: no job; lookup: a job operation)",
        labels=["kind"])
    for kind, count in sorted(counts.items()):
        family.add_metric([kind], count)
    return family


def render(families: Iterable[Metric]) -> bytes:
    """The Prometheus text exposition of `families`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families)))
    return generate_latest(registry)


def merge_replicas(texts: Mapping[str, str], extra: Iterable[Metric] = ()) -> bytes:
    """One exposition of the replicas' expositions (`texts`, by replica id), each sample
    labelled with its replica, then `extra` (the ingress's own families)."""
    merged: dict[str, Metric] = {}
    for replica_id, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(family.name, family.documentation,
                                                      family.type, family.unit)
            for sample in family.samples:
                target.add_sample(sample.name, {**sample.labels, REPLICA_LABEL: replica_id},
                                  sample.value, sample.timestamp, sample.exemplar)
    return render([*merged.values(), *extra])


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)
