"""`continuum trace timeline FILE --out PNG`: jobs over time and the block pool over steps.

Top: one row per job (in order of first arrival), coloured by what the job was doing: a
turn waiting (arrived or preempted, not admitted), running, in its tool (between a turn's
finish and the next turn's arrival), and pinned (its KV held on the device), drawn over the
tool time. Bottom: the KV block pool entering each step, stacked: in use by running requests,
pinned, free but still caching a prefix, and free. A pool that is mostly free at its busiest
step (a few dozen blocks of thousands) is drawn up to just above that step (`pool_axis_top`),
so that what it holds stays readable; the title gives the pool's size.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from tracing.pyplot import load_pyplot
from tracing.reader import Trace, read_trace_or_exit
from tracing.records import (
    JobEnded,
    PinPinned,
    PinReleased,
    PrefixCacheEvent,
    RequestArrived,
    RequestFinished,
    StepDecision,
    StepSnapshot,
)
from tracing.stdout import print_report

# Below this share of the pool held or caching at the busiest step, the pool's panel ends just
# above that step (`POOL_HEADROOM` more) rather than at the pool's size.
FULL_POOL_SHARE = 0.5
POOL_HEADROOM = 1.25
# The fewest blocks the panel's axis spans, so that an idle pool still has a scale.
MIN_POOL_AXIS_BLOCKS = 8

STATE_COLOURS = {
    "waiting": "#d62728",
    "running": "#1f77b4",
    "in_tool": "#c7c7c7",
    "pinned": "#2ca02c",
}


@dataclass(frozen=True)
class Interval:
    state: str
    start_s: float
    end_s: float


class _JobTimeline:
    """Open intervals of one job while the events are walked."""

    def __init__(self) -> None:
        self.intervals: list[Interval] = []
        self.open: dict[str, float] = {}  # state -> since

    def begin(self, state: str, time_s: float) -> None:
        self.open.setdefault(state, time_s)

    def end(self, state: str, time_s: float) -> None:
        start_s = self.open.pop(state, None)
        if start_s is not None and time_s > start_s:
            self.intervals.append(Interval(state, start_s, time_s))

    def close(self, time_s: float) -> list[Interval]:
        for state in list(self.open):
            self.end(state, time_s)
        return sorted(self.intervals, key=lambda interval: interval.start_s)


def job_intervals(trace: Trace) -> dict[str, list[Interval]]:
    """What each job was doing when, by job id in order of first arrival. A request without
    a job is a job of its own, named by its request id."""
    timelines: dict[str, _JobTimeline] = {}
    job_of: dict[str, str] = {}
    last_turns: set[str] = set()
    for event in trace.events:
        if isinstance(event, RequestArrived):
            job_id = event.job_id if event.job_id is not None else event.request_id
            job_of[event.request_id] = job_id
            if event.job_id is None or event.is_last_turn:
                last_turns.add(event.request_id)
            timeline = timelines.setdefault(job_id, _JobTimeline())
            timeline.end("in_tool", event.time_s)
            timeline.begin("waiting", event.time_s)
        elif isinstance(event, PrefixCacheEvent) and event.request_id in job_of:
            timeline = timelines[job_of[event.request_id]]
            timeline.end("waiting", event.time_s)
            timeline.begin("running", event.time_s)
        elif isinstance(event, StepDecision):
            for preemption in event.preempted:
                if preemption.request_id in job_of:
                    timeline = timelines[job_of[preemption.request_id]]
                    timeline.end("running", event.time_s)
                    timeline.begin("waiting", event.time_s)
        elif isinstance(event, RequestFinished) and event.request_id in job_of:
            timeline = timelines[job_of.pop(event.request_id)]
            timeline.end("running", event.time_s)
            timeline.end("waiting", event.time_s)
            if event.request_id not in last_turns and event.reason != "abort":
                timeline.begin("in_tool", event.time_s)
        elif isinstance(event, PinPinned):
            timelines.setdefault(event.job_id, _JobTimeline()).begin("pinned", event.time_s)
        elif isinstance(event, PinReleased) and event.job_id in timelines:
            timelines[event.job_id].end("pinned", event.time_s)
        elif isinstance(event, JobEnded) and event.job_id in timelines:
            timelines[event.job_id].end("in_tool", event.time_s)
    end_s = trace.events[-1].time_s if trace.events else 0.0
    return {job_id: timeline.close(end_s) for job_id, timeline in timelines.items()}


def pool_series(trace: Trace) -> dict[str, list[float]]:
    """Per step entering it: step number and blocks in use, pinned, cached-free and free."""
    series: dict[str, list[float]] = {key: [] for key in
                                      ("step", "in_use", "pinned", "cached", "free")}
    for snapshot in trace.of_type(StepSnapshot):
        assert isinstance(snapshot, StepSnapshot)
        held = snapshot.num_total_blocks - snapshot.num_free_blocks
        series["step"].append(snapshot.step)
        series["in_use"].append(max(0, held - snapshot.num_pinned_blocks))
        series["pinned"].append(min(held, snapshot.num_pinned_blocks))
        series["cached"].append(snapshot.num_cached_free_blocks)
        series["free"].append(snapshot.num_free_blocks - snapshot.num_cached_free_blocks)
    return series


def pool_axis_top(series: dict[str, list[float]]) -> tuple[float, int]:
    """`(axis top, pool size)` in blocks for the pool's panel: the pool's size while its
    busiest step holds or caches at least `FULL_POOL_SHARE` of it, else that step's blocks
    with `POOL_HEADROOM` (at least `MIN_POOL_AXIS_BLOCKS`), the free ones above left out."""
    steps = list(zip(series["in_use"], series["pinned"], series["cached"], series["free"],
                     strict=True))
    pool_size = int(max((sum(step) for step in steps), default=0))
    busiest = max((in_use + pinned + cached for in_use, pinned, cached, _ in steps), default=0)
    if pool_size == 0 or busiest >= FULL_POOL_SHARE * pool_size:
        return float(max(pool_size, MIN_POOL_AXIS_BLOCKS)), pool_size
    return min(float(pool_size), max(busiest * POOL_HEADROOM, MIN_POOL_AXIS_BLOCKS)), pool_size


def plot_timeline(trace: Trace, out: str | os.PathLike[str], *, max_jobs: int = 60) -> int:
    """Draws the picture into `out` (PNG); returns how many jobs it shows. ValueError where
    matplotlib is missing."""
    plt = load_pyplot()
    from matplotlib.patches import Patch

    jobs = list(job_intervals(trace).items())[:max_jobs]
    figure, (jobs_axes, pool_axes) = plt.subplots(
        2, 1, figsize=(12, 3 + 0.18 * len(jobs) + 3),
        gridspec_kw={"height_ratios": [max(2, 0.18 * len(jobs)), 2.5]},
    )
    _draw_jobs(jobs_axes, jobs)
    jobs_axes.legend(handles=[Patch(color=colour, label=state.replace("_", " "))
                              for state, colour in STATE_COLOURS.items()],
                     loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize="small", ncol=4)
    jobs_axes.set_title(f"jobs over time ({trace.header.policy})", loc="left")
    _draw_pool(pool_axes, pool_series(trace))
    figure.tight_layout()
    figure.savefig(out, format="png", dpi=100)
    plt.close(figure)
    return len(jobs)


def _draw_jobs(axes, jobs: list[tuple[str, list[Interval]]]) -> None:
    for row, (_, intervals) in enumerate(jobs):
        for layer, height in (("base", 0.8), ("pinned", 0.35)):
            spans = [(i.start_s, i.end_s - i.start_s) for i in intervals
                     if (i.state == "pinned") == (layer == "pinned")]
            colours = [STATE_COLOURS[i.state] for i in intervals
                       if (i.state == "pinned") == (layer == "pinned")]
            if spans:
                axes.broken_barh(spans, (row - height / 2, height), facecolors=colours)
    axes.set_yticks(range(len(jobs)))
    axes.set_yticklabels([job_id for job_id, _ in jobs], fontsize="x-small")
    axes.invert_yaxis()
    axes.set_xlabel("time (s, scheduler clock)")


def _draw_pool(axes, series: dict[str, list[float]]) -> None:
    labels = {"in_use": "in use", "pinned": "pinned", "cached": "free, cached", "free": "free"}
    colours = ["#1f77b4", "#2ca02c", "#ffbb78", "#f0f0f0"]
    axes.stackplot(series["step"], *(series[key] for key in labels),
                   labels=list(labels.values()), colors=colours, step="post")
    top, pool_size = pool_axis_top(series)
    axes.set_ylim(0, top)
    axes.set_xlabel("step")
    axes.set_ylabel(f"KV blocks (of {pool_size:,})")
    if top < pool_size:
        # In the headroom above the busiest step, which no series reaches.
        axes.text(0.01, 0.97, f"axis up to {top:,.0f} of the pool's {pool_size:,} blocks; "
                  "the rest is free", transform=axes.transAxes, va="top", fontsize="small")
    axes.set_title("block pool entering each step", loc="left")
    axes.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize="small", ncol=4)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="a JSONL trace written with --trace-path")
    parser.add_argument("--out", required=True, help="the PNG file to write")
    parser.add_argument("--max-jobs", type=int, default=60,
                        help="show the first N jobs by arrival")


def main(args: argparse.Namespace) -> int:
    if args.max_jobs < 1:
        raise SystemExit("--max-jobs must be at least 1")
    try:
        num_jobs = plot_timeline(read_trace_or_exit(args.trace), args.out,
                                 max_jobs=args.max_jobs)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    return print_report(f"wrote {args.out} ({num_jobs} jobs)")
