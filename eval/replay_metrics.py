"""What a replay (simulated or over HTTP) measured: per turn, per job, and for the run.

Job completion time (JCT) runs from the job's first arrival to the end of its last turn.
A turn's queueing delay runs from its arrival to the step that first scheduled it (the
simulator sees it; over HTTP it is unknown); its TTFT from its arrival to its first token.
The cached-token fraction is the prompt tokens served from the prefix cache (as `usage`
reports them, host-tier hits included) over all prompt tokens.

In a mixed run (agent jobs beside plain chat sessions) every job figure counts the agent jobs
only; the `chat_*` fields describe the chat requests (each turn of each session) apart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from engine.core.wire import EngineStats


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """One finished turn; `queue_s` is None where it cannot be observed."""

    queue_s: float | None
    ttft_s: float
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int


@dataclass(slots=True)
class JobRecord:
    """One job: its arrival, its finished turns, when its last turn ended (None if it did
    not) and the error that stopped it, if one did. `replica_ids`: the replica that answered
    each turn sent (a failed one included), where a replicated server names it."""

    job_id: str
    arrival_s: float
    turns: list[TurnRecord] = field(default_factory=list)
    finished_s: float | None = None
    error: str | None = None
    replica_ids: list[str] = field(default_factory=list)

    @property
    def jct_s(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.arrival_s


@dataclass(frozen=True)
class RunMetrics:
    """The figures of one run (one policy at one load), as written to `--json`.

    `tokens_per_s` counts generated tokens; `prompt_tokens_per_s` prompt tokens. The engine
    counters (`preemptions`, `recomputed_tokens`, pins) are None when the server does not
    expose them; `recomputed_tokens` are the tokens computed again after preemption (what a
    preemption dropped that the readmission did not find in the prefix cache).
    `busy_fraction` (the engine's busy time over the run, chat included) and
    `leaked_blocks` come from the simulator only. Queueing and TTFT
    figures are in seconds; `*_queue_s` cover agent turns. The `chat_*` fields are None
    unless plain chat sessions ran beside the jobs: their sessions, requests (finished
    turns), and the requests' queueing delay and TTFT percentiles. The `host_*` fields are
    None unless the engine had a host KV tier: the share of the tokens looked up in the prefix
    cache at admissions that were loaded from the tier, and the tokens stored to and loaded
    from it (engine counters, every request included).
    """

    num_jobs: int
    num_finished_jobs: int
    failures: int
    makespan_s: float
    mean_jct_s: float | None
    p50_jct_s: float | None
    p90_jct_s: float | None
    p99_jct_s: float | None
    throughput_jobs_per_s: float
    tokens_per_s: float
    prompt_tokens_per_s: float
    num_turns: int
    mean_ttft_s: float | None
    p90_ttft_s: float | None
    mean_queue_s: float | None
    p50_queue_s: float | None
    p90_queue_s: float | None
    p99_queue_s: float | None
    cached_token_fraction: float
    preemptions: int | None = None
    recomputed_tokens: int | None = None
    pins_created: int | None = None
    pins_released: dict[str, int] | None = None
    busy_fraction: float | None = None
    leaked_blocks: int | None = None
    chat_num_sessions: int | None = None
    chat_num_requests: int | None = None
    chat_queue_p50_s: float | None = None
    chat_queue_p99_s: float | None = None
    chat_ttft_p50_s: float | None = None
    chat_ttft_p99_s: float | None = None
    host_hit_token_fraction: float | None = None
    host_stored_tokens: int | None = None
    host_loaded_tokens: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def num_finished_by(jobs: Sequence[JobRecord], by_s: float) -> int:
    """Jobs whose last turn ended within `by_s` seconds of the first job's arrival: what a
    run stopped at `by_s` would have finished."""
    start_s = min((job.arrival_s for job in jobs), default=0.0)
    return sum(1 for job in jobs
               if job.finished_s is not None and job.finished_s - start_s <= by_s)


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize_run(
    jobs: Sequence[JobRecord], stats: EngineStats | None = None, *,
    busy_s: float | None = None, leaked_blocks: int | None = None,
    chat: Sequence[JobRecord] | None = None,
) -> RunMetrics:
    """The run's figures from its job records, and the engine's counters when known; `chat`
    holds the records of plain chat sessions run beside the jobs, if any. `busy_s` is the
    engine's busy time over the whole run, from the first arrival to the last finish of a job
    or session."""
    jcts = [job.jct_s for job in jobs if job.jct_s is not None]
    turns = [turn for job in jobs for turn in job.turns]
    start_s = min((job.arrival_s for job in jobs), default=0.0)
    end_s = max((job.finished_s for job in jobs if job.finished_s is not None), default=start_s)
    makespan_s = end_s - start_s
    per_s = 1.0 / makespan_s if makespan_s > 0 else 0.0
    queues = [turn.queue_s for turn in turns if turn.queue_s is not None]
    ttfts = [turn.ttft_s for turn in turns]
    num_prompt_tokens = sum(turn.num_prompt_tokens for turn in turns)
    return RunMetrics(
        num_jobs=len(jobs),
        num_finished_jobs=len(jcts),
        failures=sum(1 for job in jobs if job.error is not None),
        makespan_s=makespan_s,
        mean_jct_s=mean(jcts),
        p50_jct_s=percentile(jcts, 50),
        p90_jct_s=percentile(jcts, 90),
        p99_jct_s=percentile(jcts, 99),
        throughput_jobs_per_s=len(jcts) * per_s,
        tokens_per_s=sum(turn.num_output_tokens for turn in turns) * per_s,
        prompt_tokens_per_s=num_prompt_tokens * per_s,
        num_turns=len(turns),
        mean_ttft_s=mean(ttfts),
        p90_ttft_s=percentile(ttfts, 90),
        mean_queue_s=mean(queues),
        p50_queue_s=percentile(queues, 50),
        p90_queue_s=percentile(queues, 90),
        p99_queue_s=percentile(queues, 99),
        cached_token_fraction=(
            sum(turn.num_cached_tokens for turn in turns) / num_prompt_tokens
            if num_prompt_tokens else 0.0
        ),
        preemptions=None if stats is None else stats.num_preemptions,
        recomputed_tokens=None if stats is None else stats.recomputed_tokens,
        pins_created=None if stats is None else stats.num_pins_created,
        pins_released=None if stats is None else dict(stats.pins_released),
        busy_fraction=_busy_fraction(busy_s, [*jobs, *(chat or ())]),
        leaked_blocks=leaked_blocks,
        **({} if chat is None else chat_figures(chat)),
        **host_tier_figures(stats),
    )


def _busy_fraction(busy_s: float | None, records: Sequence[JobRecord]) -> float | None:
    start_s = min((record.arrival_s for record in records), default=0.0)
    end_s = max((r.finished_s for r in records if r.finished_s is not None), default=start_s)
    return None if busy_s is None or end_s <= start_s else busy_s / (end_s - start_s)


def host_tier_figures(stats: EngineStats | None) -> dict[str, int | float]:
    """The `host_*` fields of `RunMetrics` from the engine's counters; none without a tier."""
    if stats is None or not stats.num_host_kv_blocks:
        return {}
    queried = stats.prefix_cache_query_tokens
    return {
        "host_hit_token_fraction":
            stats.prefix_cache_host_hit_tokens / queried if queried else 0.0,
        "host_stored_tokens": stats.host_kv_stored_tokens,
        "host_loaded_tokens": stats.host_kv_loaded_tokens,
    }


def chat_figures(sessions: Sequence[JobRecord]) -> dict[str, int | float | None]:
    """The `chat_*` fields of `RunMetrics` from the chat sessions' records."""
    turns = [turn for session in sessions for turn in session.turns]
    queues = [turn.queue_s for turn in turns if turn.queue_s is not None]
    ttfts = [turn.ttft_s for turn in turns]
    return {
        "chat_num_sessions": len(sessions),
        "chat_num_requests": len(turns),
        "chat_queue_p50_s": percentile(queues, 50),
        "chat_queue_p99_s": percentile(queues, 99),
        "chat_ttft_p50_s": percentile(ttfts, 50),
        "chat_ttft_p99_s": percentile(ttfts, 99),
    }
