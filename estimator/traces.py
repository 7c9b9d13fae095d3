"""Tool-call sequences of agent jobs, read from the agent-job trace format.

The format (`eval/workloads/SOURCES.md`): one job per line with `job_id`, `arrival_s` and
`turns`; a turn has `tool_name` and `tool_duration_s` (null on the last turn) and either
`input_tokens` + `output_tokens` or `context_tokens_after`. Only what estimators need is kept.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

# Used when a trace records neither the model's time for a turn nor the server's latency.
DEFAULT_TURN_TIME_S = 1.0


@dataclass(frozen=True, slots=True)
class TraceToolCall:
    """One non-final turn and the tool it ran: `duration_s` from the turn's finish to the
    next turn's arrival; `num_context_tokens` the turn's prompt plus output; `turn_index` the
    turn's place in its job (0 for the first)."""

    tool_name: str | None
    duration_s: float
    num_context_tokens: int
    turn_time_s: float
    turn_index: int = 0


@dataclass(frozen=True, slots=True)
class TraceJob:
    """An agent job: its tool calls in order, and how many turns it had in all."""

    job_id: str
    arrival_s: float
    calls: tuple[TraceToolCall, ...]
    num_turns: int


def read_trace_jobs(path: str | Path) -> list[TraceJob]:
    """The jobs of an agent-job JSONL file, in file order; ValueError if it cannot be read
    or a line is not a job."""
    try:
        with open(path) as lines:
            return list(_parse_lines(path, lines))
    except OSError as error:
        raise ValueError(f"cannot read trace {path}: {error}") from error


def _parse_lines(path: str | Path, lines: Iterable[str]) -> Iterator[TraceJob]:
    for line_number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield _parse_job(json.loads(line))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{path}:{line_number}: not an agent job: {error}") from error


def _parse_job(data: dict) -> TraceJob:
    turns = data["turns"]
    if not isinstance(turns, list) or not turns:
        raise ValueError("turns must be a non-empty list")
    calls = []
    for turn_index, turn in enumerate(turns[:-1]):
        duration_s = turn.get("tool_duration_s")
        if duration_s is None:
            continue  # a turn whose tool time was not recorded teaches nothing
        calls.append(TraceToolCall(
            tool_name=turn.get("tool_name") or None,
            duration_s=max(0.0, float(duration_s)),
            num_context_tokens=_context_tokens(turn),
            turn_time_s=float(
                turn.get("llm_latency_s") or turn.get("server_latency_s") or DEFAULT_TURN_TIME_S
            ),
            turn_index=turn_index,
        ))
    return TraceJob(str(data["job_id"]), float(data.get("arrival_s") or 0.0), tuple(calls),
                    len(turns))


def _context_tokens(turn: dict) -> int:
    if turn.get("context_tokens_after") is not None:
        return int(turn["context_tokens_after"])
    return int(turn.get("input_tokens") or 0) + int(turn.get("output_tokens") or 0)
