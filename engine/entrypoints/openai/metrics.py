"""Prometheus metrics of the server: request latencies and outcomes from the frontend, and the
core's queues, KV pool, host KV tier, prefix cache, preemptions and pins from its
`EngineStats`.

Each server has its own registry (no process-global state). Frontend metrics are observed as
outputs arrive (`PrometheusMetrics` is the output processor's `RequestStatsObserver`); core
metrics are the snapshot fetched when `/metrics` is scraped.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.core.wire import EngineStats
from engine.entrypoints.openai.body_budget import BodyByteBudget
from engine.entrypoints.openai.refusal_pacing import RefusalPacer
from engine.frontend.stats import FinishedCompletionStats

PREFIX = "continuum:"

_LATENCY_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)
_TOKEN_INTERVAL_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
)


class _CoreStatsCollector(Collector):
    """Exposes the latest `EngineStats` snapshot (nothing before the first one)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: EngineStats | None = None

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if stats is None:
            return
        model = self.model_name
        yield _gauge("num_requests_running", "Requests running in the engine.", model,
                     stats.num_running)
        yield _gauge("num_requests_waiting", "Requests waiting to be scheduled.", model,
                     stats.num_waiting)
        yield _gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", model,
                     stats.kv_usage)
        yield _gauge("kv_cache_total_blocks", "KV blocks in the pool.", model,
                     stats.num_kv_blocks)
        yield _gauge("kv_cache_free_blocks", "KV blocks no request or pin holds (cached "
                     "prefixes included).", model, stats.num_free_blocks)
        yield _gauge("num_pins", "Live KV pins (jobs holding their KV between turns).", model,
                     stats.num_pins)
        yield _gauge("pinned_blocks", "KV blocks held by pins.", model, stats.num_pinned_blocks)
        yield _gauge("num_jobs", "Agent jobs the scheduling policy keeps state for.", model,
                     stats.num_jobs)
        yield _counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                       model, stats.prefix_cache_query_tokens)
        yield _counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", model,
                       stats.prefix_cache_hit_tokens)
        yield from _host_tier_metrics(stats, model)
        yield _counter("num_preemptions", "Requests preempted (to be recomputed).", model,
                       stats.num_preemptions)
        yield _counter("recomputed_tokens", "Tokens computed again after preemption (dropped by "
                       "a preemption, not found in the prefix cache at readmission).", model,
                       stats.recomputed_tokens)
        yield _counter("pins_created", "KV pins created.", model, stats.num_pins_created)
        yield _labelled_counter("pins_created_by_source", "KV pins created, by who asked: the "
                                "policy, or a client's cache breakpoint.", model, "source",
                                stats.pins_created)
        yield _counter("jobs_created", "Agent jobs the scheduling policy started books for.",
                       model, stats.num_jobs_created)
        yield _counter("jobs_inferred", "Jobs the scheduler inferred for requests that named "
                       "none.", model, stats.num_jobs_inferred)
        yield _labelled_counter("jobs_ended", "Jobs ended, by reason.", model, "reason",
                                stats.jobs_ended)
        released = CounterMetricFamily(PREFIX + "pins_released", "KV pins released, by reason.",
                                       labels=["model_name", "reason"])
        for reason, count in sorted(stats.pins_released.items()):
            released.add_metric([model, reason], count)
        yield released
        yield _counter("engine_steps", "Engine steps run.", model, stats.num_steps)
        yield _counter("invariant_checks", "Steps, idle sweeps that changed something and "
                       "async scheduling's last step out, whose scheduler and KV invariants "
                       "were checked (--debug-check-invariants).", model,
                       stats.num_invariant_checks)


def _labelled_counter(name: str, documentation: str, model: str, label: str,
                      counts: dict[str, int]) -> Metric:
    family = CounterMetricFamily(PREFIX + name, documentation, labels=["model_name", label])
    for value, count in sorted(counts.items()):
        family.add_metric([model, value], count)
    return family


def _host_tier_metrics(stats: EngineStats, model: str) -> Iterator[Metric]:
    """The host KV tier's series; all 0 without a tier (`--kv-offload-gib` 0)."""
    yield _counter("prefix_cache_host_hits", "Prompt tokens found in the host KV tier (part "
                   "of prefix_cache_hits).", model, stats.prefix_cache_host_hit_tokens)
    yield _gauge("host_kv_cache_total_blocks", "KV blocks in the host tier (0: no tier).",
                 model, stats.num_host_kv_blocks)
    yield _gauge("host_kv_cache_used_blocks", "Host tier KV blocks holding KV.", model,
                 stats.num_used_host_kv_blocks)
    yield _counter("host_kv_cache_stored_tokens", "Tokens of KV stored from the device to the "
                   "host tier.", model, stats.host_kv_stored_tokens)
    yield _counter("host_kv_cache_loaded_tokens", "Tokens of KV loaded from the host tier to "
                   "the device.", model, stats.host_kv_loaded_tokens)


def _gauge(name: str, documentation: str, model: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(PREFIX + name, documentation, labels=["model_name"])
    family.add_metric([model], value)
    return family


def _counter(name: str, documentation: str, model: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(PREFIX + name, documentation, labels=["model_name"])
    family.add_metric([model], value)
    return family


def body_budget_families(budget: BodyByteBudget, pacer: RefusalPacer, *,
                         prefix: str = PREFIX, labels: Mapping[str, str] | None = None
                         ) -> list[Metric]:
    """What `budget` holds and has refused, and how many of those refusals `pacer` answered
    late, as metric families named from `prefix`, each sample with `labels`: the server's
    (labelled by its model) and the Ray ingress's own (`continuum:ingress_...`)."""
    labels = labels or {}
    names, values = list(labels), list(labels.values())
    held = GaugeMetricFamily(prefix + "request_body_bytes_held", "Bytes of request bodies "
                             "held by the requests in progress.", labels=names)
    held.add_metric(values, budget.held_bytes)
    refused = CounterMetricFamily(
        prefix + "request_bodies_refused", "Requests refused because their body would pass "
        "the tenant's share (429) or the total (503) of body bytes.",
        labels=[*names, "status"])
    for status in (429, 503):
        refused.add_metric([*values, str(status)], budget.num_refused[status])
    paced = CounterMetricFamily(
        prefix + "request_body_refusals_paced", "Of those refusals, how many were answered "
        "Retry-After seconds late: their tenant's previous refusal had been answered less "
        "than that before.", labels=names)
    paced.add_metric(values, pacer.num_paced)
    return [held, refused, paced]


class _BodyBudgetCollector(Collector):
    """Exposes `body_budget_families` of the server's budget and pacer at each scrape."""

    def __init__(self, model_name: str, budget: BodyByteBudget, pacer: RefusalPacer) -> None:
        self.model_name = model_name
        self.budget = budget
        self.pacer = pacer

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        yield from body_budget_families(self.budget, self.pacer,
                                        labels={"model_name": self.model_name})


class PrometheusMetrics:
    """The server's metrics registry. Frontend observations may come at any time from the event
    loop; `update_core_stats` is called before each scrape."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self._finished = Counter(
            PREFIX + "request_success", "Finished completions, by finish reason.",
            ["model_name", "finished_reason"], registry=self.registry,
        )
        self._prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished completions.", labels,
            registry=self.registry,
        ).labels(model_name)
        self._generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated by finished completions.", labels,
            registry=self.registry,
        ).labels(model_name)
        self._ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time from arrival to the first token.",
            labels, buckets=_LATENCY_BUCKETS_S, registry=self.registry,
        ).labels(model_name)
        self._inter_token = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between successive output tokens.",
            labels, buckets=_TOKEN_INTERVAL_BUCKETS_S, registry=self.registry,
        ).labels(model_name)
        self._e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Time from arrival to the last token.",
            labels, buckets=_LATENCY_BUCKETS_S, registry=self.registry,
        ).labels(model_name)
        self.model_name = model_name
        self._core = _CoreStatsCollector(model_name)
        self.registry.register(self._core)

    # RequestStatsObserver
    def on_first_token(self, ttft_s: float) -> None:
        self._ttft.observe(ttft_s)

    def on_inter_token(self, interval_s: float) -> None:
        self._inter_token.observe(interval_s)

    def on_completion_finished(self, stats: FinishedCompletionStats) -> None:
        self._finished.labels(self.model_name, stats.finish_reason).inc()
        self._prompt_tokens.inc(stats.num_prompt_tokens)
        self._generation_tokens.inc(stats.num_generation_tokens)
        self._e2e.observe(stats.e2e_latency_s)

    def update_core_stats(self, stats: EngineStats) -> None:
        self._core.stats = stats

    def track_body_budget(self, budget: BodyByteBudget, pacer: RefusalPacer) -> None:
        """Reports `budget` and the `pacer` of its refusals (the server's, registered once by
        `build_app`) at each scrape."""
        self.registry.register(_BodyBudgetCollector(self.model_name, budget, pacer))

    def render(self) -> bytes:
        """The registry in Prometheus' text exposition format."""
        return generate_latest(self.registry)
