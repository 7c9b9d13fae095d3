"""Reports of policy comparisons: a markdown table per workload and a JCT-against-load plot.

A run is a dict with `policy`, `jobs_per_s` and the `RunMetrics` fields, as in the `--json`
output of `continuum bench sim` and `continuum bench agent`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

BASELINE_POLICY = "fcfs"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _load(value: float | None) -> str:
    return "all at once" if value is None else f"{value:g}"


def speedup(runs: Sequence[dict], run: dict, metric: str = "mean_jct_s") -> float | None:
    """`metric` of the baseline policy at the same load over the run's (>1: the run is
    faster); None without a baseline run."""
    baseline = next((other for other in runs if other["policy"] == BASELINE_POLICY
                     and other["jobs_per_s"] == run["jobs_per_s"]), None)
    if baseline is None or not baseline.get(metric) or not run.get(metric):
        return None
    return baseline[metric] / run[metric]


def markdown_table(runs: Sequence[dict]) -> str:
    """One row per (load, policy), loads ascending, policies in run order."""
    lines = [
        "| jobs/s | policy | mean JCT (s) | p90 JCT (s) | p99 JCT (s) | vs fcfs (mean) "
        "| mean queueing (s) | cached tokens | preemptions |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    loads = sorted({run["jobs_per_s"] for run in runs}, key=lambda v: (v is not None, v or 0))
    for load in loads:
        for run in (run for run in runs if run["jobs_per_s"] == load):
            ratio = speedup(runs, run)
            queue_s = run["mean_queue_s"]
            lines.append(
                f"| {_load(load)} | {run['policy']} | {_seconds(run['mean_jct_s'])} "
                f"| {_seconds(run['p90_jct_s'])} | {_seconds(run['p99_jct_s'])} "
                f"| {'-' if ratio is None else f'{ratio:.2f}x'} "
                f"| {'-' if queue_s is None else f'{queue_s:.2f}'} "
                f"| {run['cached_token_fraction']:.1%} "
                f"| {'-' if run['preemptions'] is None else run['preemptions']} |"
            )
    return "\n".join(lines)


def plot_jct_vs_load(runs: Sequence[dict], path: str | Path, *, title: str) -> None:
    """A PNG: mean and p90 job completion time against load, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    policies = list(dict.fromkeys(run["policy"] for run in runs))
    figure, axes = pyplot.subplots(1, 2, figsize=(11, 4), sharex=True)
    for metric, axis, label in (("mean_jct_s", axes[0], "mean JCT (s)"),
                                ("p90_jct_s", axes[1], "p90 JCT (s)")):
        for policy in policies:
            points = sorted((run["jobs_per_s"], run[metric]) for run in runs
                            if run["policy"] == policy and run["jobs_per_s"] is not None
                            and run[metric] is not None)
            if points:
                axis.plot(*zip(*points, strict=True), marker="o", label=policy)
        axis.set_xlabel("load (jobs/s)")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    axes[0].legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
