"""An asyncio client that replays agent jobs against any OpenAI-compatible server.

Each job is one task: at its arrival it sends turn 0; when a turn ends it sleeps the tool's
duration and sends the next turn, whose prompt is the previous prompt, the generated tokens
and the turn's appended tokens. Turns are streamed `/v1/completions` requests with the job
extension (`job_id`, `is_last_step`, `tool_name`), a forced output length (`max_tokens`,
`min_tokens` and `ignore_eos`) and `return_token_ids`, so the next prompt repeats the
generated tokens exactly. Prompts are token ids drawn from `[1, vocab_size)` (valid for any
tokenizer at the default 256), or words in the `text` format for servers that take no ids.
Servers that return no token ids get placeholder ids of the generated count.

A replay may be stopped `stop_after_s` seconds after it started (as the first GPU runs were
stopped at 222 s): the turns in flight are cancelled (their connections close, so the server
aborts them), and the jobs not finished by then count as unfinished, not as failures.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

import httpx
import openai

from eval.replay_metrics import JobRecord, RunMetrics, TurnRecord, summarize_run
from eval.workload import AgentJobSpec

PROMPT_FORMATS = ("ids", "text")
_WORDS = ("alpha", "bravo", "delta", "echo", "gamma", "kilo", "lima", "omega", "sigma", "tango")
# The header a replicated server (`continuum serve --replicas`) names the answering replica in.
REPLICA_HEADER = "x-continuum-replica"
_COUNTER = re.compile(r"^(\S+?)(?:_total)?(\{[^}]*\})?\s+([0-9.eE+-]+)$")


@dataclass(frozen=True)
class ReplaySettings:
    """Where and how to replay. `base_url` is the server's root, with or without the `/v1`
    that OpenAI clients take (kept without it); `model=None` takes the server's first model;
    `request_timeout_s` bounds each turn. ValueError for a URL that is not http(s)."""

    base_url: str
    model: str | None = None
    api_key: str = "EMPTY"
    prompt_format: str = "ids"
    vocab_size: int = 256
    request_timeout_s: float = 600.0
    seed: int = 0

    def __post_init__(self) -> None:
        root = self.base_url.strip().rstrip("/").removesuffix("/v1").rstrip("/")
        if urlsplit(root).scheme not in ("http", "https") or not urlsplit(root).netloc:
            raise ValueError(f"base_url must be an http(s) URL such as http://127.0.0.1:8000, "
                             f"got {self.base_url!r}")
        object.__setattr__(self, "base_url", root)
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}")
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")


class AgentReplay:
    """Replays `jobs` arriving at `arrivals_s` (seconds from the start, parallel lists);
    `on_job_done` is called as each job ends (a progress bar). After `run`, `records` holds
    each job's record, in job order (a job that had not arrived when a run stopped has no
    turns); during it, `started` holds the records of the jobs that have arrived, filling as
    their turns finish."""

    def __init__(
        self, jobs: list[AgentJobSpec], arrivals_s: list[float], settings: ReplaySettings,
        *, on_job_done: Callable[[JobRecord], None] | None = None,
    ) -> None:
        if len(jobs) != len(arrivals_s) or not jobs:
            raise ValueError("need one arrival time per job, and at least one job")
        self.jobs = jobs
        self.arrivals_s = arrivals_s
        self.settings = settings
        self.on_job_done = on_job_done
        self.records: list[JobRecord] = []
        self.started: list[JobRecord] = []
        self._start_s = 0.0

    async def run(self, stop_after_s: float | None = None) -> RunMetrics:
        """Replays every job; with `stop_after_s`, stops that many seconds after the start
        (the first arrival is at 0 s), cancelling the turns in flight and leaving the jobs
        not finished by then unfinished (no `finished_s`, no `error`)."""
        if stop_after_s is not None and stop_after_s <= 0:
            raise ValueError(f"stop_after_s must be > 0, got {stop_after_s}")
        settings = self.settings
        limits = httpx.Limits(max_connections=len(self.jobs) + 8, max_keepalive_connections=64)
        async with httpx.AsyncClient(limits=limits, timeout=settings.request_timeout_s) as http:
            client = openai.AsyncOpenAI(base_url=settings.base_url + "/v1",
                                        api_key=settings.api_key, http_client=http,
                                        max_retries=0)
            model = settings.model or (await client.models.list()).data[0].id
            counters_before = await scrape_counters(http, settings)
            self._start_s = time.monotonic()
            records = [JobRecord(job.job_id, arrival_s)
                       for job, arrival_s in zip(self.jobs, self.arrivals_s, strict=True)]
            tasks = [asyncio.ensure_future(self._run_job(client, model, job, record))
                     for job, record in zip(self.jobs, records, strict=True)]
            _, unfinished = await asyncio.wait(tasks, timeout=stop_after_s)
            for task in unfinished:
                task.cancel()
            await asyncio.gather(*unfinished, return_exceptions=True)
            self.records = records
            counters_after = await scrape_counters(http, settings)
        return _with_server_counters(summarize_run(self.records), counters_before,
                                     counters_after)

    def _now_s(self) -> float:
        return time.monotonic() - self._start_s

    async def _run_job(
        self, client: openai.AsyncOpenAI, model: str, job: AgentJobSpec, record: JobRecord
    ) -> None:
        """Runs `job` into `record`, whose `arrival_s` is its planned arrival until it
        arrives."""
        await asyncio.sleep(max(0.0, record.arrival_s - self._now_s()))
        record.arrival_s = self._now_s()
        self.started.append(record)
        context: list[int] | str = [] if self.settings.prompt_format == "ids" else ""
        try:
            for turn_index, turn in enumerate(job.turns):
                prompt = context + self._appended(job, turn_index)
                context, turn_record = await self._run_turn(client, model, job, turn_index,
                                                            prompt, record)
                record.turns.append(turn_record)
                if turn.tool_duration_s is not None:
                    await asyncio.sleep(turn.tool_duration_s)
            record.finished_s = self._now_s()
        except (openai.OpenAIError, httpx.HTTPError, ValueError) as error:
            record.error = f"turn {len(record.turns)}: {type(error).__name__}: {error}"
        if self.on_job_done is not None:
            self.on_job_done(record)

    def _appended(self, job: AgentJobSpec, turn_index: int) -> list[int] | str:
        rng = random.Random(zlib.crc32(f"{self.settings.seed}:{job.job_id}:{turn_index}".encode()))
        count = job.turns[turn_index].num_appended_tokens
        if self.settings.prompt_format == "ids":
            return [rng.randrange(1, self.settings.vocab_size) for _ in range(count)]
        return "".join(" " + rng.choice(_WORDS) for _ in range(count))

    async def _run_turn(
        self, client: openai.AsyncOpenAI, model: str, job: AgentJobSpec, turn_index: int,
        prompt: list[int] | str, job_record: JobRecord,
    ) -> tuple[list[int] | str, TurnRecord]:
        turn = job.turns[turn_index]
        sent_s = self._now_s()
        raw = await client.completions.with_raw_response.create(
            model=model, prompt=prompt, max_tokens=turn.num_output_tokens, stream=True,
            stream_options={"include_usage": True}, temperature=0.0,
            extra_body={
                "job_id": job.job_id, "is_last_step": turn_index == len(job.turns) - 1,
                "tool_name": turn.tool_name, "ignore_eos": True,
                "min_tokens": turn.num_output_tokens, "return_token_ids": True,
            },
        )
        replica_id = raw.headers.get(REPLICA_HEADER)
        if replica_id is not None:
            job_record.replica_ids.append(replica_id)
        stream = raw.parse()
        first_token_s = None
        token_ids: list[int] = []
        text = ""
        usage = None
        async for chunk in stream:
            for choice in chunk.choices:
                if first_token_s is None and (choice.text or getattr(choice, "token_ids", None)):
                    first_token_s = self._now_s()
                text += choice.text or ""
                token_ids.extend(getattr(choice, "token_ids", None) or [])
            usage = chunk.usage or usage
        num_output = usage.completion_tokens if usage is not None else len(token_ids)
        details = getattr(usage, "prompt_tokens_details", None)
        record = TurnRecord(
            queue_s=None,
            ttft_s=(self._now_s() if first_token_s is None else first_token_s) - sent_s,
            num_prompt_tokens=usage.prompt_tokens if usage is not None else len(prompt),
            num_cached_tokens=getattr(details, "cached_tokens", None) or 0,
            num_output_tokens=num_output,
        )
        if isinstance(prompt, str):
            return prompt + text, record
        if len(token_ids) != num_output:  # a server that returns no ids
            token_ids = [1] * num_output
        return prompt + token_ids, record


async def scrape_counters(http: httpx.AsyncClient, settings: ReplaySettings) -> dict[str, float]:
    """The server's Prometheus counters (unlabelled and summed over labels), if it serves
    `/metrics`; empty otherwise."""
    headers = {"Authorization": f"Bearer {settings.api_key}"}
    try:
        response = await http.get(settings.base_url + "/metrics", headers=headers,
                                  timeout=10.0)
    except httpx.HTTPError:
        return {}
    if response.status_code != 200:
        return {}
    counters: dict[str, float] = {}
    for line in response.text.splitlines():
        match = _COUNTER.match(line.strip())
        if match and not line.startswith("#"):
            name = match.group(1)
            counters[name] = counters.get(name, 0.0) + float(match.group(3))
    return counters


def _with_server_counters(
    metrics: RunMetrics, before: dict[str, float], after: dict[str, float]
) -> RunMetrics:
    """Fills the engine counters from the server's metrics (ours `continuum:`, vLLM's
    `vllm:`), as the run's increase."""
    def delta(*names: str) -> int | None:
        for name in names:
            if name in after:
                return round(after[name] - before.get(name, 0.0))
        return None

    return replace(metrics,
                   preemptions=delta("continuum:num_preemptions", "vllm:num_preemptions"),
                   recomputed_tokens=delta("continuum:recomputed_tokens"),
                   pins_created=delta("continuum:pins_created"))
