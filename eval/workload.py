"""Agent jobs to replay, loaded from the agent-job trace format (`eval/workloads/SOURCES.md`).

A job is a sequence of turns. Turn k's prompt is turn k-1's prompt, plus its generated tokens,
plus `num_appended_tokens` new ones (the tool result); turn 0's prompt is its appended tokens.
After a non-final turn the agent runs its tool for `tool_duration_s` seconds.

The loader fills what a trace lacks, deterministically for a seed:
- a missing tool duration is drawn from the empirical quantiles of its tool class
  (`tool_duration_quantiles.json`), or of all tools when the class is unknown;
- a trace that records only `context_tokens_after` (prompt + output of each non-final turn)
  is split assuming `output_tokens_per_turn` generated tokens per turn; the last turn, which
  records nothing, appends the job's mean appended count;
- a prompt that shrinks (a client that trimmed its context) appends nothing.
Token counts marked `est` (estimated from characters) are used as they are; the job says so.

Turn scaling (`LoadOptions.repeat_turns = K`, the paper's experiment): each job's turns are
repeated K times in sequence, each token count (appended and generated) divided by K, rounded,
and kept at least 1 where it was not 0; tool durations are kept. The join between two
repetitions follows the original last turn, which called no tool: it takes the job's median
tool call (the lower median of its non-final turns by duration, the earlier turn on ties),
its duration and its tool name; a one-turn job takes the median call of all the trace's jobs
in the same way, and a trace with no tool call at all joins with 0 s and no tool.

Drawing (`draw_jobs`, `draw_sessions`): N jobs (or chat sessions) drawn uniformly with
replacement, seeded; the k-th draw (from 0) of job `J` is renamed `J~k`, so every draw is a
distinct job.

Chat sessions (`load_chat_sessions`): the same format read as plain chat, such as the Mooncake
conversation sessions. A session's turns are requests without a job; each prompt extends the
previous prompt and output by the turn's appended tokens (a shrinking prompt appends nothing,
as above). The gap between two turns is the difference of their `t_arrival_s`, else the later
turn's `gap_from_parent_arrival_s` (the session is replayed as one linear conversation even
where the trace branches from an earlier turn); a replay sends the next turn that long after
the previous one arrived, but never before the previous answer is complete.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import random
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

QUANTILE_LEVELS = (("p10", 0.10), ("p25", 0.25), ("p50", 0.50), ("p75", 0.75), ("p90", 0.90),
                   ("p95", 0.95), ("p99", 0.99))
ALL_TOOLS = "ALL"
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class TurnSpec:
    """One LLM request of a job: `num_appended_tokens` new prompt tokens, exactly
    `num_output_tokens` generated, then `tool_duration_s` of tool time (None on the last
    turn). `tool_name` is the tool this turn calls, when known."""

    num_appended_tokens: int
    num_output_tokens: int
    tool_name: str | None
    tool_duration_s: float | None


@dataclass(frozen=True, slots=True)
class AgentJobSpec:
    """An agent job as a replay needs it. `tokens_estimated`: the trace estimated its token
    counts from characters."""

    job_id: str
    turns: tuple[TurnSpec, ...]
    tokens_estimated: bool = False

    def prompt_len(self, turn_index: int) -> int:
        """Tokens in the prompt of turn `turn_index`."""
        previous = self.turns[:turn_index]
        return (sum(t.num_appended_tokens + t.num_output_tokens for t in previous)
                + self.turns[turn_index].num_appended_tokens)

    @property
    def max_seq_len(self) -> int:
        """The longest sequence of the job: the last turn's prompt and output."""
        return self.prompt_len(len(self.turns) - 1) + self.turns[-1].num_output_tokens

    @property
    def num_output_tokens(self) -> int:
        return sum(turn.num_output_tokens for turn in self.turns)


class ToolDurationSampler:
    """Draws tool durations (seconds) from per-tool-class quantiles, by inverse CDF with linear
    interpolation between the recorded levels (`p10` ... `p99`, `max`)."""

    def __init__(self, quantiles: Mapping[str, Mapping[str, float]]) -> None:
        if ALL_TOOLS not in quantiles:
            raise ValueError(f"tool quantiles need an {ALL_TOOLS!r} class")
        self._curves = {name: _inverse_cdf(name, q) for name, q in quantiles.items()}

    @classmethod
    def from_file(cls, path: str | Path) -> ToolDurationSampler:
        """From `tool_duration_quantiles.json`: the classes of every source merged, the first
        source's `ALL` as the fallback. ValueError if the file is not such a table."""
        try:
            sources = json.loads(Path(path).read_text())["sources"]
            merged: dict[str, Mapping[str, float]] = {}
            for classes in sources.values():
                for name, quantiles in classes.items():
                    merged.setdefault(name, quantiles)
        except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"cannot read tool duration quantiles {path}: {error}") from error
        return cls(merged)

    def sample_s(self, tool_name: str | None, rng: random.Random) -> float:
        levels, values = self._curves.get(tool_name or ALL_TOOLS, self._curves[ALL_TOOLS])
        u = rng.random()
        index = min(bisect.bisect_right(levels, u), len(levels) - 1)
        low_level, high_level = levels[index - 1], levels[index]
        low, high = values[index - 1], values[index]
        return low + (high - low) * (u - low_level) / (high_level - low_level)


def _inverse_cdf(name: str, quantiles: Mapping[str, float]) -> tuple[list[float], list[float]]:
    try:
        points = [(level, float(quantiles[key])) for key, level in QUANTILE_LEVELS]
        points.append((1.0, float(quantiles.get("max", points[-1][1]))))
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"tool class {name!r}: bad quantiles: {error}") from error
    # Below p10 nothing is recorded: ramp from half of p10.
    points.insert(0, (0.0, points[0][1] / 2))
    values = [max(0.0, value) for _, value in points]
    if values != sorted(values):
        raise ValueError(f"tool class {name!r}: quantiles must not decrease")
    return [level for level, _ in points], values


@dataclass(frozen=True)
class LoadOptions:
    """How a trace becomes jobs: at most `max_jobs` jobs (the first in file order) of at most
    `max_turns` turns (the cut turn becomes the last); `output_tokens_per_turn` splits
    `context_tokens_after`; `token_scale` multiplies every token count (rounded, at least one
    generated token per turn), to fit a small model; `repeat_turns` repeats each job's turns
    that many times with token counts divided by it (see the module docstring); `seed` drives
    the synthesis of missing tool durations."""

    max_jobs: int | None = None
    max_turns: int | None = None
    output_tokens_per_turn: int = 80
    token_scale: float = 1.0
    repeat_turns: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("max_jobs", "max_turns"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.output_tokens_per_turn < 1:
            raise ValueError("output_tokens_per_turn must be >= 1")
        if not 0 < self.token_scale < float("inf"):
            raise ValueError(f"token_scale must be a positive number, got {self.token_scale!r}")
        if self.repeat_turns < 1:
            raise ValueError(f"repeat_turns must be >= 1, got {self.repeat_turns}")


def load_jobs(
    path: str | Path, options: LoadOptions = LoadOptions(), *,
    tool_durations: ToolDurationSampler | None = None,
) -> list[AgentJobSpec]:
    """The jobs of an agent-job JSONL file. ValueError naming the line if one is not a job, or
    if a tool duration is missing and no `tool_durations` sampler was given. A one-turn job
    that records no context gets the median first prompt of the others."""
    records = _read_records(path, options.max_jobs)
    first_prompt_default = _median_first_prompt(records, options.output_tokens_per_turn)
    jobs = []
    for line_number, record in records:
        try:
            jobs.append(_parse_job(record, options, tool_durations, first_prompt_default))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{path}:{line_number}: not an agent job: {error}") from error
    if options.repeat_turns == 1:
        return jobs
    pooled = _median_tool_call([turn for job in jobs for turn in job.turns[:-1]])
    return [repeat_turns(job, options.repeat_turns, _median_tool_call(job.turns[:-1]) or pooled)
            for job in jobs]


def repeat_turns(
    job: AgentJobSpec, times: int, join: tuple[str | None, float] | None
) -> AgentJobSpec:
    """The job with its turns repeated `times` times, token counts divided by `times`; the
    original last turn, where it is not the job's last, calls `join` (tool name, seconds;
    None: no tool, 0 s)."""
    if times < 1:
        raise ValueError(f"times must be >= 1, got {times}")
    scaled = tuple(TurnSpec(_divide(turn.num_appended_tokens, times),
                            _divide(turn.num_output_tokens, times),
                            turn.tool_name, turn.tool_duration_s) for turn in job.turns)
    tool_name, duration_s = join or (None, 0.0)
    joined = (*scaled[:-1], TurnSpec(scaled[-1].num_appended_tokens,
                                     scaled[-1].num_output_tokens, tool_name, duration_s))
    return dataclasses.replace(job, turns=joined * (times - 1) + scaled)


def _divide(count: int, times: int) -> int:
    """`count / times` rounded; at least 1 unless `count` is 0."""
    return 0 if count == 0 else max(1, round(count / times))


def _median_tool_call(turns: Sequence[TurnSpec]) -> tuple[str | None, float] | None:
    """The lower-median tool call of `turns` by duration (the earlier turn on ties), as
    (tool name, seconds); None if no turn calls a tool."""
    calls = sorted(((turn.tool_duration_s, index, turn.tool_name)
                    for index, turn in enumerate(turns) if turn.tool_duration_s is not None),
                   key=lambda call: (call[0], call[1]))
    if not calls:
        return None
    duration_s, _, tool_name = calls[(len(calls) - 1) // 2]
    return tool_name, duration_s


def draw_with_replacement(items: Sequence[T], count: int, *, seed: int,
                          salt: str = "jobs") -> list[tuple[int, T]]:
    """`count` items drawn uniformly with replacement, as (draw index from 0, item); the same
    `seed` and `salt` give the same draws, and a larger `count` extends a smaller one's."""
    if count < 1:
        raise ValueError(f"the number of draws must be >= 1, got {count}")
    if not items:
        raise ValueError("nothing to draw from")
    rng = random.Random(zlib.crc32(f"{salt}:{seed}".encode()))
    return [(k, items[rng.randrange(len(items))]) for k in range(count)]


def draw_jobs(jobs: Sequence[AgentJobSpec], count: int, *, seed: int) -> list[AgentJobSpec]:
    """`count` jobs drawn with replacement; the k-th draw of job `J` is renamed `J~k`."""
    return [dataclasses.replace(job, job_id=f"{job.job_id}~{k}")
            for k, job in draw_with_replacement(jobs, count, seed=seed)]


@dataclass(frozen=True, slots=True)
class ChatTurnSpec:
    """One chat request: `num_appended_tokens` new prompt tokens, exactly `num_output_tokens`
    generated; `gap_s` seconds from its arrival to the next turn's (None on the last)."""

    num_appended_tokens: int
    num_output_tokens: int
    gap_s: float | None


@dataclass(frozen=True, slots=True)
class ChatSessionSpec:
    """A plain chat session: turns sent without a job, each extending the previous one."""

    session_id: str
    turns: tuple[ChatTurnSpec, ...]

    @property
    def max_seq_len(self) -> int:
        """The longest sequence: every turn's appended and generated tokens."""
        return sum(turn.num_appended_tokens + turn.num_output_tokens for turn in self.turns)


def load_chat_sessions(
    path: str | Path, *, token_scale: float = 1.0, output_tokens_per_turn: int = 80,
) -> list[ChatSessionSpec]:
    """The sessions of an agent-job JSONL file read as plain chat (see the module docstring);
    `token_scale` as for jobs. ValueError naming the line of a record that is not a session
    or whose later turns record no arrival time."""
    records = _read_records(path, None)
    first_prompt_default = _median_first_prompt(records, output_tokens_per_turn)
    sessions = []
    for line_number, record in records:
        try:
            sessions.append(_parse_session(record, token_scale, output_tokens_per_turn,
                                           first_prompt_default))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{path}:{line_number}: not a chat session: {error}") from error
    return sessions


def draw_sessions(
    sessions: Sequence[ChatSessionSpec], count: int, *, seed: int
) -> list[ChatSessionSpec]:
    """`count` sessions drawn with replacement (independently of `draw_jobs` for the same
    seed); the k-th draw of session `S` is renamed `S~k`."""
    return [dataclasses.replace(session, session_id=f"{session.session_id}~{k}")
            for k, session in draw_with_replacement(sessions, count, seed=seed, salt="chat")]


def _parse_session(
    data: dict, token_scale: float, output_per_turn: int, first_prompt_default: int
) -> ChatSessionSpec:
    turns = data["turns"]
    if not isinstance(turns, list) or not turns:
        raise ValueError("turns must be a non-empty list")
    counts = _token_counts(turns, output_per_turn, first_prompt_default)
    gaps = [*(_gap_s(turns, index) for index in range(1, len(turns))), None]
    specs = tuple(
        ChatTurnSpec(max(1 if index == 0 else 0, round(appended * token_scale)),
                     max(1, round(output * token_scale)), gap_s)
        for index, ((appended, output), gap_s) in enumerate(zip(counts, gaps, strict=True))
    )
    return ChatSessionSpec(str(data["job_id"]), specs)


def _gap_s(turns: list[dict], index: int) -> float:
    """Seconds from turn `index - 1`'s arrival to turn `index`'s."""
    turn, previous = turns[index], turns[index - 1]
    if turn.get("t_arrival_s") is not None and previous.get("t_arrival_s") is not None:
        gap_s = float(turn["t_arrival_s"]) - float(previous["t_arrival_s"])
    elif turn.get("gap_from_parent_arrival_s") is not None:
        gap_s = float(turn["gap_from_parent_arrival_s"])
    else:
        raise ValueError(f"turn {index} records neither t_arrival_s nor "
                         "gap_from_parent_arrival_s")
    return max(0.0, gap_s)


def _read_records(path: str | Path, max_jobs: int | None) -> list[tuple[int, dict]]:
    records = []
    try:
        with open(path) as lines:
            for line_number, line in enumerate(lines, 1):
                if max_jobs is not None and len(records) >= max_jobs:
                    break
                if not line.strip():
                    continue
                try:
                    records.append((line_number, json.loads(line)))
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{line_number}: not JSON: {error}") from error
    except OSError as error:
        raise ValueError(f"cannot read trace {path}: {error}") from error
    if not records:
        raise ValueError(f"{path}: no jobs")
    return records


def _median_first_prompt(records: list[tuple[int, dict]], output_per_turn: int) -> int:
    """For jobs that record no context at all (one turn, `context_tokens_after` null): the
    median first prompt of the jobs that do."""
    firsts = sorted(
        turns[0]["context_tokens_after"] - output_per_turn
        for _, record in records
        if isinstance(turns := record.get("turns"), list) and turns
        and isinstance(turns[0], dict) and isinstance(turns[0].get("context_tokens_after"), int)
    )
    return max(1, firsts[len(firsts) // 2]) if firsts else output_per_turn


def _parse_job(
    data: dict, options: LoadOptions, tool_durations: ToolDurationSampler | None,
    first_prompt_default: int,
) -> AgentJobSpec:
    job_id = str(data["job_id"])
    turns = data["turns"]
    if not isinstance(turns, list) or not turns:
        raise ValueError("turns must be a non-empty list")
    turns = turns[:options.max_turns]
    token_counts = list(_token_counts(turns, options.output_tokens_per_turn,
                                      first_prompt_default))
    rng = random.Random(zlib.crc32(f"{options.seed}:{job_id}".encode()))
    specs = []
    for index, (turn, (appended, output)) in enumerate(zip(turns, token_counts, strict=True)):
        tool_name = turn.get("tool_name") or None
        duration_s = None
        if index < len(turns) - 1:
            duration_s = turn.get("tool_duration_s")
            if duration_s is None:
                if tool_durations is None:
                    raise ValueError(f"turn {index} has no tool_duration_s and no quantiles "
                                     "were given to synthesize one")
                duration_s = tool_durations.sample_s(tool_name, rng)
            duration_s = max(0.0, float(duration_s))
        scale = options.token_scale
        specs.append(TurnSpec(max(1 if index == 0 else 0, round(appended * scale)),
                              max(1, round(output * scale)), tool_name, duration_s))
    estimated = any(turn.get("est") for turn in turns) or "tokens_estimated_chars_per_token" in data
    return AgentJobSpec(job_id, tuple(specs), tokens_estimated=estimated)


def _token_counts(
    turns: list[dict], output_per_turn: int, first_prompt_default: int
) -> Iterator[tuple[int, int]]:
    """(appended, output) per turn."""
    if "input_tokens" in turns[0]:
        for index, turn in enumerate(turns):
            output = max(1, int(turn["output_tokens"]))
            if index == 0:
                appended = int(turn["input_tokens"])
            else:
                previous = turns[index - 1]
                appended = (int(turn["input_tokens"]) - int(previous["input_tokens"])
                            - int(previous["output_tokens"]))
            yield max(1 if index == 0 else 0, appended), output
        return
    yield from _split_context_after(turns, output_per_turn, first_prompt_default)


def _split_context_after(
    turns: list[dict], output_per_turn: int, first_prompt_default: int
) -> Iterator[tuple[int, int]]:
    contexts = [turn.get("context_tokens_after") for turn in turns]
    known = [int(c) for c in contexts[:-1] if c is not None]
    if len(known) != len(turns) - 1:
        raise ValueError("every non-final turn needs context_tokens_after")
    appended = []
    previous_context = 0
    for context in known:
        prompt = max(1, context - output_per_turn)
        appended.append(max(0, prompt - previous_context))
        previous_context = prompt + output_per_turn
    if contexts[-1] is not None:
        last = int(contexts[-1]) - output_per_turn - previous_context
    elif len(appended) > 1:
        last = round(sum(appended[1:]) / (len(appended) - 1))
    elif appended:
        last = appended[0]
    else:
        last = first_prompt_default
    appended.append(max(0, last))
    for count in appended:
        yield count, output_per_turn
