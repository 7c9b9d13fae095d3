"""`continuum trace summarize`: what a trace says about jobs, turns, the prefix cache and pins.

Definitions (times on the scheduler clock, seconds):
- a job's completion time runs from its first turn's arrival to its last turn's finish, for
  jobs the engine ended (`job_ended`: last turn finished, or released) with every turn
  finished, none aborted; other jobs (still going when the trace ends, or cut short: a run
  stopped mid-job aborts its turns in flight) have none;
- a turn's queueing delay runs from its arrival to its first admission;
- prefix-cache hit rates are over first admissions: hit tokens / prompt tokens, split into
  hits on device blocks the request's own job's pin held (`from_pins`), on other device
  blocks (`from_cache`) and on blocks loaded from the host KV tier (`from_host`);
- recomputed tokens are the tokens a preemption dropped that the readmission did not get
  back from the prefix cache, either tier (dropped minus hit, at least 0);
- host-tier copies (`host_tier`) are summed over every step: blocks stored to the host tier
  and loaded back from it (admissions after a preemption included).
A trace without the host tier's fields reads them as 0.
"""

from __future__ import annotations

import argparse
import math
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from tracing.reader import Trace, read_trace_or_exit
from tracing.records import (
    JobEnded,
    PinDeclined,
    PinPinned,
    PinReleased,
    PrefixCacheEvent,
    RequestArrived,
    RequestFinished,
    StepDecision,
)
from tracing.stdout import print_report

ABORT_REASON = "abort"  # `RequestFinished.reason` of a request the client or shutdown ended


class Distribution(msgspec.Struct, kw_only=True):
    """Count, mean and nearest-rank percentiles of some values (None when there are none)."""

    count: int
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, values: Iterable[float]) -> Distribution:
        ordered = sorted(values)
        if not ordered:
            return cls(count=0)
        return cls(
            count=len(ordered), mean=math.fsum(ordered) / len(ordered),
            p50=_percentile(ordered, 0.50), p90=_percentile(ordered, 0.90),
            p99=_percentile(ordered, 0.99), max=ordered[-1],
        )


class JobSummary(msgspec.Struct, kw_only=True):
    job_id: str
    num_turns: int
    first_arrival_s: float
    completion_s: float | None
    queueing_s: float
    num_preemptions: int
    prompt_tokens: int
    hit_tokens: int
    pin_hit_tokens: int
    host_hit_tokens: int


class PrefixCacheSummary(msgspec.Struct, kw_only=True):
    """First admissions' hits; `hit_tokens` = `pin_hit_tokens` + `device_hit_tokens` (device
    blocks no pin of the job held) + `host_hit_tokens` (loaded from the host tier)."""

    prompt_tokens: int
    hit_tokens: int
    pin_hit_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int
    hit_rate: float | None
    from_pins: float | None
    from_cache: float | None
    from_host: float | None


class HostTierSummary(msgspec.Struct, kw_only=True):
    """Blocks copied between the device and the host KV tier, summed over the steps."""

    stored_blocks: int
    loaded_blocks: int
    num_steps_storing: int
    num_steps_loading: int


class PinSummary(msgspec.Struct, kw_only=True):
    num_pinned: int
    num_declined: int
    released: dict[str, int]
    num_live_at_end: int
    ttl_s: Distribution
    held_s: Distribution


class TraceSummary(msgspec.Struct, kw_only=True):
    path: str
    policy: str
    num_steps: int
    duration_s: float
    truncated: bool
    num_requests: int
    finished: dict[str, int]
    num_jobs: int
    job_completion_s: Distribution
    turn_queueing_s: Distribution
    prefix_cache: PrefixCacheSummary
    host_tier: HostTierSummary
    pins: PinSummary
    preemptions: int
    recomputed_tokens: int
    scheduled_tokens: int
    jobs: list[JobSummary]

    def scalars(self) -> dict[str, float | int | None]:
        """Every single figure by a dotted name (for tables and comparisons)."""
        flat: dict[str, float | int | None] = {}
        _flatten(msgspec.to_builtins(self), "", flat, skip={"jobs", "path", "policy"})
        return flat


@dataclass
class _Turn:
    job_id: str | None
    arrived_s: float
    admitted_s: float | None = None
    finished_s: float | None = None
    aborted: bool = False
    num_preemptions: int = 0


@dataclass
class _Tally:
    """Running totals while walking the events once."""

    turns: dict[str, _Turn] = field(default_factory=dict)
    finished: Counter[str] = field(default_factory=Counter)
    cache: list[PrefixCacheEvent] = field(default_factory=list)
    recomputed_tokens: int = 0
    dropped_tokens: dict[str, int] = field(default_factory=dict)  # by request, last preemption
    ended_jobs: set[str] = field(default_factory=set)
    pinned: list[PinPinned] = field(default_factory=list)
    num_declined: int = 0
    released: list[PinReleased] = field(default_factory=list)
    preemptions: int = 0
    scheduled_tokens: int = 0
    steps: set[int] = field(default_factory=set)
    stored_blocks: list[int] = field(default_factory=list)  # per step that stored any
    loaded_blocks: list[int] = field(default_factory=list)  # per step that loaded any


def summarize(trace: Trace) -> TraceSummary:
    tally = _tally(trace)
    events = trace.events
    duration_s = events[-1].time_s - events[0].time_s if events else 0.0
    turn_queueing = [t.admitted_s - t.arrived_s for t in tally.turns.values()
                     if t.admitted_s is not None]
    jobs = _job_summaries(tally)
    return TraceSummary(
        path=str(trace.path), policy=trace.header.policy, num_steps=len(tally.steps),
        duration_s=duration_s, truncated=trace.truncated, num_requests=len(tally.turns),
        finished=dict(sorted(tally.finished.items())), num_jobs=len(jobs),
        job_completion_s=Distribution.of(
            job.completion_s for job in jobs if job.completion_s is not None),
        turn_queueing_s=Distribution.of(turn_queueing),
        prefix_cache=_prefix_cache(e for e in tally.cache if not e.resumed),
        host_tier=HostTierSummary(
            stored_blocks=sum(tally.stored_blocks), loaded_blocks=sum(tally.loaded_blocks),
            num_steps_storing=len(tally.stored_blocks),
            num_steps_loading=len(tally.loaded_blocks),
        ),
        pins=_pins(tally), preemptions=tally.preemptions,
        recomputed_tokens=tally.recomputed_tokens, scheduled_tokens=tally.scheduled_tokens,
        jobs=jobs,
    )


def _tally(trace: Trace) -> _Tally:
    tally = _Tally()
    turns = tally.turns
    for event in trace.events:
        if isinstance(event, StepDecision):
            _decision(tally, event)
        elif isinstance(event, RequestArrived):
            turns[event.request_id] = _Turn(event.job_id, event.time_s)
        elif isinstance(event, PrefixCacheEvent):
            _admission(tally, event)
        elif isinstance(event, RequestFinished):
            tally.finished[event.reason] += 1
            if event.request_id in turns:
                turns[event.request_id].finished_s = event.time_s
                turns[event.request_id].aborted = event.reason == ABORT_REASON
        elif isinstance(event, PinPinned):
            tally.pinned.append(event)
        elif isinstance(event, PinDeclined):
            tally.num_declined += 1
        elif isinstance(event, PinReleased):
            tally.released.append(event)
        elif isinstance(event, JobEnded):
            tally.ended_jobs.add(event.job_id)
    return tally


def _decision(tally: _Tally, event: StepDecision) -> None:
    tally.steps.add(event.step)
    tally.scheduled_tokens += event.total_num_scheduled_tokens
    tally.preemptions += len(event.preempted)
    for preemption in event.preempted:
        tally.dropped_tokens[preemption.request_id] = preemption.num_computed_tokens
        if preemption.request_id in tally.turns:
            tally.turns[preemption.request_id].num_preemptions += 1
    if event.num_stored_blocks:
        tally.stored_blocks.append(event.num_stored_blocks)
    if event.num_loaded_blocks:
        tally.loaded_blocks.append(event.num_loaded_blocks)


def _admission(tally: _Tally, event: PrefixCacheEvent) -> None:
    tally.cache.append(event)
    if event.resumed:
        dropped = tally.dropped_tokens.pop(event.request_id, 0)
        tally.recomputed_tokens += max(0, dropped - event.num_hit_tokens)
        return
    turn = tally.turns.get(event.request_id)
    if turn is not None and turn.admitted_s is None:
        turn.admitted_s = event.time_s


def _job_summaries(tally: _Tally) -> list[JobSummary]:
    turns_of: dict[str, list[str]] = {}
    for request_id, turn in tally.turns.items():
        if turn.job_id is not None:
            turns_of.setdefault(turn.job_id, []).append(request_id)
    first_admissions = {e.request_id: e for e in tally.cache if not e.resumed}
    summaries = []
    for job_id, request_ids in turns_of.items():
        turns = [tally.turns[r] for r in request_ids]
        admissions = [first_admissions[r] for r in request_ids if r in first_admissions]
        first_arrival_s = min(t.arrived_s for t in turns)
        done = job_id in tally.ended_jobs and all(
            t.finished_s is not None and not t.aborted for t in turns)
        summaries.append(JobSummary(
            job_id=job_id, num_turns=len(turns), first_arrival_s=first_arrival_s,
            completion_s=max(t.finished_s for t in turns) - first_arrival_s if done else None,
            queueing_s=math.fsum(t.admitted_s - t.arrived_s for t in turns
                                 if t.admitted_s is not None),
            num_preemptions=sum(t.num_preemptions for t in turns),
            prompt_tokens=sum(a.num_prompt_tokens for a in admissions),
            hit_tokens=sum(a.num_hit_tokens for a in admissions),
            pin_hit_tokens=sum(a.num_pin_hit_tokens for a in admissions),
            host_hit_tokens=sum(a.num_host_hit_tokens for a in admissions),
        ))
    return summaries


def _prefix_cache(admissions: Iterable[PrefixCacheEvent]) -> PrefixCacheSummary:
    prompt = hit = pin_hit = host_hit = 0
    for event in admissions:
        prompt += event.num_prompt_tokens
        hit += event.num_hit_tokens
        pin_hit += event.num_pin_hit_tokens
        host_hit += event.num_host_hit_tokens
    device_hit = hit - pin_hit - host_hit
    return PrefixCacheSummary(
        prompt_tokens=prompt, hit_tokens=hit, pin_hit_tokens=pin_hit,
        device_hit_tokens=device_hit, host_hit_tokens=host_hit,
        hit_rate=_ratio(hit, prompt), from_pins=_ratio(pin_hit, prompt),
        from_cache=_ratio(device_hit, prompt), from_host=_ratio(host_hit, prompt),
    )


def _pins(tally: _Tally) -> PinSummary:
    released = Counter(event.reason for event in tally.released)
    return PinSummary(
        num_pinned=len(tally.pinned), num_declined=tally.num_declined,
        released=dict(sorted(released.items())),
        num_live_at_end=len(tally.pinned) - len(tally.released),
        ttl_s=Distribution.of(event.ttl_s for event in tally.pinned if event.ttl_s is not None),
        held_s=Distribution.of(event.held_s for event in tally.released),
    )


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def _percentile(ordered: Sequence[float], fraction: float) -> float:
    """Nearest rank: the smallest value with at least `fraction` of the values at or below."""
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


def _flatten(value: object, prefix: str, out: dict[str, float | int | None],
             skip: set[str]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            if key not in skip:
                _flatten(item, f"{prefix}{key}.", out, skip=set())
    elif isinstance(value, bool):
        out[prefix[:-1]] = int(value)
    elif value is None or isinstance(value, int | float):
        out[prefix[:-1]] = value


def format_table(rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned first column, right-aligned others."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def format_value(value: float | int | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


def render(summary: TraceSummary, *, num_slowest_jobs: int = 10) -> str:
    rows = [("figure", "value")]
    rows += [(name, format_value(value)) for name, value in summary.scalars().items()]
    text = f"trace {summary.path} (policy {summary.policy})\n" + format_table(rows)
    slowest = sorted((job for job in summary.jobs if job.completion_s is not None),
                     key=lambda job: job.completion_s or 0.0, reverse=True)[:num_slowest_jobs]
    if slowest:
        job_rows = [("slowest jobs", "turns", "completion_s", "queueing_s", "preemptions",
                     "pin hit tokens", "host hit tokens")]
        job_rows += [(job.job_id, str(job.num_turns), format_value(job.completion_s),
                      format_value(job.queueing_s), str(job.num_preemptions),
                      str(job.pin_hit_tokens), str(job.host_hit_tokens)) for job in slowest]
        text += "\n\n" + format_table(job_rows)
    return text


def write_json(value: msgspec.Struct | dict, path: str | os.PathLike[str]) -> None:
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(value)) + b"\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="a JSONL trace written with --trace-path")
    parser.add_argument("--json", dest="json_path", default=None,
                        help="also write the summary (per-job figures included) here")
    parser.add_argument("--slowest-jobs", type=int, default=10,
                        help="how many of the slowest jobs to list")


def main(args: argparse.Namespace) -> int:
    summary = summarize(read_trace_or_exit(args.trace))
    status = print_report(render(summary, num_slowest_jobs=args.slowest_jobs))
    if args.json_path is not None:
        write_json(summary, args.json_path)
    return status
