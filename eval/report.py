"""Reports of the benchmarks: a command's figures as a two-column table on stdout and
optionally as JSON (`emit`), a report written to a file (`write_report`), and policy
comparisons as a markdown table per workload and a JCT-against-load plot.

A run of a policy comparison is a dict with `label` (the policy spec as written; `policy`
where a run has no label), `jobs_per_s` and the `RunMetrics` fields, as in the `--json` output
of `continuum bench sim` and `continuum bench agent` (runs written before `recomputed_tokens`
existed show `-` in its column). Runs with plain chat sessions beside the jobs (`chat_*`
figures) get the chat requests' queueing and TTFT columns; runs with a host KV tier (`host_*`
figures), the share of looked-up prompt tokens loaded from it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tracing.pyplot import load_pyplot

BASELINE_POLICY = "fcfs"


def emit(title: str, results: dict[str, Any], json_path: str | None) -> None:
    """Prints `results` as a table under `title`; writes them as JSON to `json_path` if set."""
    width = max(len(key) for key in results)
    print(title)
    for key, value in results.items():
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"  {key:<{width}}  {shown}")
    if json_path:
        write_json_report(json_path, results)


def write_report(path: str | Path, text: str) -> None:
    """Writes `text` to `path`, making its directory if need be, and says so on stdout."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")


def write_json_report(path: str | Path, results: Any) -> None:
    """`write_report` of `results` as indented JSON."""
    write_report(path, json.dumps(results, indent=2) + "\n")


def run_label(run: dict) -> str:
    """The name of the run's row and line: its label, else its policy."""
    return str(run.get("label") or run["policy"])


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _fine_seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _load(value: float | None) -> str:
    return "all at once" if value is None else f"{value:g}"


def speedup(runs: Sequence[dict], run: dict, metric: str = "mean_jct_s") -> float | None:
    """`metric` of the baseline run (labelled `fcfs`) at the same load over the run's (>1:
    the run is faster); None without a baseline run."""
    baseline = next((other for other in runs if run_label(other) == BASELINE_POLICY
                     and other["jobs_per_s"] == run["jobs_per_s"]), None)
    if baseline is None or not baseline.get(metric) or not run.get(metric):
        return None
    return baseline[metric] / run[metric]


def _has_chat(runs: Sequence[dict]) -> bool:
    return any(run.get("chat_num_requests") is not None for run in runs)


def _finished_by_s(runs: Sequence[dict]) -> float | None:
    """The cut the runs counted finished jobs at (`bench sim --finished-by-s`), if any."""
    return next((run["finished_by_s"] for run in runs if run.get("finished_by_s")), None)


def _has_host_tier(runs: Sequence[dict]) -> bool:
    return any(run.get("host_hit_token_fraction") is not None for run in runs)


def _count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _row(runs: Sequence[dict], run: dict, with_chat: bool, with_host: bool,
         with_cut: bool) -> str:
    ratio = speedup(runs, run)
    cells = [
        _load(run["jobs_per_s"]), run_label(run), _seconds(run["mean_jct_s"]),
        _seconds(run["p90_jct_s"]), _seconds(run["p99_jct_s"]),
        "-" if ratio is None else f"{ratio:.2f}x", _fine_seconds(run["mean_queue_s"]),
        f"{run['cached_token_fraction']:.1%}",
        "-" if run["preemptions"] is None else str(run["preemptions"]),
        _count(run.get("recomputed_tokens")),
    ]
    if with_host:
        cells.append(_percent(run.get("host_hit_token_fraction")))
    if with_cut:
        cells.append(f"{run.get('num_finished_by_s', '-')}/{run['num_jobs']}")
    if with_chat:
        cells += [
            f"{_fine_seconds(run.get('chat_queue_p50_s'))} / "
            f"{_fine_seconds(run.get('chat_queue_p99_s'))}",
            f"{_fine_seconds(run.get('chat_ttft_p50_s'))} / "
            f"{_fine_seconds(run.get('chat_ttft_p99_s'))}",
        ]
    return "| " + " | ".join(cells) + " |"


def markdown_table(runs: Sequence[dict]) -> str:
    """One row per (load, policy spec), loads ascending, specs in run order; with a host
    tier, the share of looked-up tokens loaded from it; with a cut (`finished_by_s`), the
    jobs finished by then; with chat sessions, their requests' queueing and TTFT p50 / p99
    (seconds) too."""
    with_chat = _has_chat(runs)
    with_host = _has_host_tier(runs)
    cut_s = _finished_by_s(runs)
    header = ("| jobs/s | policy | mean JCT (s) | p90 JCT (s) | p99 JCT (s) | vs fcfs (mean) "
              "| mean queueing (s) | cached tokens | preemptions | recomputed tokens |")
    rule = "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    if with_host:
        header += " from host tier |"
        rule += "---:|"
    if cut_s is not None:
        header += f" jobs done by {cut_s:g} s |"
        rule += "---:|"
    if with_chat:
        header += " chat queueing p50 / p99 (s) | chat TTFT p50 / p99 (s) |"
        rule += "---:|---:|"
    lines = [header, rule]
    loads = sorted({run["jobs_per_s"] for run in runs}, key=lambda v: (v is not None, v or 0))
    for load in loads:
        lines.extend(_row(runs, run, with_chat, with_host, cut_s is not None)
                     for run in runs if run["jobs_per_s"] == load)
    return "\n".join(lines)


def plot_jct_vs_load(runs: Sequence[dict], path: str | Path, *, title: str) -> None:
    """A PNG: mean and p90 job completion time against load, one line per policy spec;
    ValueError where matplotlib is missing."""
    pyplot = load_pyplot()

    labels = list(dict.fromkeys(run_label(run) for run in runs))
    figure, axes = pyplot.subplots(1, 2, figsize=(11, 4), sharex=True)
    for metric, axis, axis_label in (("mean_jct_s", axes[0], "mean JCT (s)"),
                                     ("p90_jct_s", axes[1], "p90 JCT (s)")):
        for label in labels:
            points = sorted((run["jobs_per_s"], run[metric]) for run in runs
                            if run_label(run) == label and run["jobs_per_s"] is not None
                            and run[metric] is not None)
            if points:
                axis.plot(*zip(*points, strict=True), marker="o", label=label)
        axis.set_xlabel("load (jobs/s)")
        axis.set_ylabel(axis_label)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
