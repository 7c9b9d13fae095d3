"""The load test's clients: hundreds of concurrent asyncio clients against one server, and
the requests they send.

Each client repeatedly picks a scenario (weights in `LoadMix`) until the run's request budget
or time limit is spent:

- `stream_completion`, `completion`, `stream_chat`, `chat`: one short request (exactly
  `max_tokens` tokens, forced with `ignore_eos`), read to the end and checked (status, finish
  reason, usage, `[DONE]`);
- `stream_disconnect`: a long streaming request closed after a few chunks;
- `give_up`: a long non-streaming request cancelled after a short client-side timeout;
- `agent_job`: several turns with one `job_id` (token-id prompts that extend the previous
  turn's prompt and output, so the prefix cache and pins serve them), a tool gap slept
  between turns, ended by `is_last_step` or, for a share, by `DELETE /v1/jobs/{id}`.

One generation request is an HTTP exchange (plain JSON or an SSE stream, optionally cut short
or given up on, `exchange`) and the check of a complete answer (`check_answer`); it ends in a
`Reply`. Outcomes: ok, disconnected and gave up (deliberate), rejected (429), and errors by
status or exception type (anything else, including a 200 whose body is wrong). The job and
model requests other runs make too (`served_model`, `delete_job`) are here as well.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from lab.flags import bench_setting

OK, DISCONNECTED, GAVE_UP, REJECTED, ERROR = "ok", "disconnected", "gave_up", "rejected", "error"
SCENARIOS = ("stream_completion", "completion", "stream_chat", "chat", "stream_disconnect",
             "give_up", "agent_job")
_SYSTEM_PROMPT = "You are a load-test assistant. Answer briefly."
_SHARED_PREFIXES = ("Summarise the following log lines for an on-call engineer: ",
                    "Translate this sentence into French, keeping names unchanged: ")
_PRINTABLE_IDS = (32, 127)  # byte ids of printable ASCII in the tiny tokenizer


@dataclass(frozen=True)
class Reply:
    """How one request ended, and the generated token ids when it completed."""

    outcome: str
    token_ids: tuple[int, ...] = ()
    error: str | None = None


async def exchange(http: httpx.AsyncClient, path: str, body: dict[str, Any], *, stream: bool,
                   cut_after_chunks: int | None = None,
                   give_up_after_s: float | None = None) -> Reply:
    """Sends `body` to `path` and reads the answer: the whole of it, the first
    `cut_after_chunks` chunks of a stream, or what arrives within `give_up_after_s`.
    Transport errors raise `httpx.HTTPError`."""
    reading = (_stream(http, path, body, cut_after_chunks) if stream
               else _post(http, path, body))
    return await _within(reading, give_up_after_s)


async def _within(reading: Awaitable[Reply], give_up_after_s: float | None) -> Reply:
    if give_up_after_s is None:
        return await reading
    try:
        return await asyncio.wait_for(reading, give_up_after_s)
    except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
        return Reply(GAVE_UP)


def forced_length(max_tokens: int, stream: bool) -> dict[str, Any]:
    """Body fields that make a completion generate exactly `max_tokens` tokens (and report
    its usage when streamed)."""
    body: dict[str, Any] = {"max_tokens": max_tokens, "min_tokens": max_tokens,
                            "ignore_eos": True}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _post(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Reply:
    response = await http.post(path, json=body)
    if response.status_code != 200:
        return _refused(response.status_code)
    try:
        payload = response.json()
        choice = payload["choices"][0]
        usage = payload["usage"]
    except (ValueError, KeyError, IndexError, TypeError):
        return Reply(ERROR, error="malformed body")
    return check_answer(body, choice.get("finish_reason"), usage,
                        tuple(choice.get("token_ids") or ()))


async def _stream(http: httpx.AsyncClient, path: str, body: dict[str, Any],
                  cut_after_chunks: int | None) -> Reply:
    """Reads an SSE stream to `[DONE]`, or closes it after `cut_after_chunks` chunks."""
    async with http.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return _refused(response.status_code)
        num_chunks = 0
        finish_reason = usage = None
        token_ids: list[int] = []
        async for line in sse_lines(response.aiter_bytes()):
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return check_answer(body, finish_reason, usage, tuple(token_ids))
            try:
                chunk = json.loads(line[len("data: "):])
            except ValueError:
                return Reply(ERROR, error=f"malformed chunk {line[:160]!r}")
            if "error" in chunk:
                return Reply(ERROR, error=f"error event: {chunk['error']}")
            for choice in chunk.get("choices", ()):
                finish_reason = choice.get("finish_reason") or finish_reason
                token_ids.extend(choice.get("token_ids") or ())
            usage = chunk.get("usage") or usage
            num_chunks += 1
            if cut_after_chunks is not None and num_chunks >= cut_after_chunks:
                return Reply(DISCONNECTED)
    return Reply(ERROR, error="stream ended without [DONE]")


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of an event stream, split at CR, LF or CRLF only, as the SSE format says.
    (httpx's `aiter_lines` also splits at U+0085, U+2028 and U+2029, which JSON leaves
    unescaped inside strings, so generated text can cut a `data:` line in two.)"""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        # A CR at the end may be the first half of a CRLF split between chunks.
        held = b"\r" if buffer.endswith(b"\r") else b""
        text = buffer[:len(buffer) - len(held)]
        *lines, rest = text.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        buffer = rest + held
        for line in lines:
            yield line.decode("utf-8", errors="replace")
    if buffer.rstrip(b"\r"):
        yield buffer.rstrip(b"\r").decode("utf-8", errors="replace")


def _refused(status: int) -> Reply:
    if status == 429:
        return Reply(REJECTED)
    return Reply(ERROR, error=f"HTTP {status}")


def check_answer(body: dict[str, Any], finish_reason: str | None,
                 usage: dict[str, Any] | None, token_ids: tuple[int, ...]) -> Reply:
    """A complete answer must have generated exactly the forced number of tokens."""
    expected = body["max_tokens"]
    if finish_reason != "length":
        return Reply(ERROR, error=f"finish_reason {finish_reason}")
    if usage is None or usage.get("completion_tokens") != expected:
        return Reply(ERROR, error="wrong completion_tokens")
    if body.get("return_token_ids") and len(token_ids) != expected:
        return Reply(ERROR, error="wrong token_ids")
    return Reply(OK, token_ids=token_ids)


async def served_model(http: httpx.AsyncClient) -> str:
    """The id of the server's (first) model, from `/v1/models`."""
    response = await http.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def delete_job(http: httpx.AsyncClient, job_id: str) -> int | None:
    """`DELETE /v1/jobs/{job_id}`; the status, or None if the request failed."""
    try:
        response = await http.delete(f"/v1/jobs/{job_id}")
    except httpx.HTTPError:
        return None
    return response.status_code


@dataclass(frozen=True)
class LoadMix:
    """Relative weights with which a client picks its next scenario (see the module)."""

    stream_completion: float = 3.0
    completion: float = 2.0
    stream_chat: float = 2.0
    chat: float = 2.0
    stream_disconnect: float = 2.0
    give_up: float = 1.0
    agent_job: float = 3.0

    def __post_init__(self) -> None:
        weights = [getattr(self, name) for name in SCENARIOS]
        if any(weight < 0 for weight in weights) or sum(weights) <= 0:
            raise ValueError("scenario weights must be >= 0 with a positive sum")

    def weights(self) -> list[float]:
        return [getattr(self, name) for name in SCENARIOS]


@dataclass(frozen=True)
class LoadSettings:
    """One load phase. `num_requests` generation requests at most (agent turns included;
    `DELETE`s are not counted) from `num_clients` concurrent clients; no scenario starts after
    `time_limit_s`, and requests still running `request_timeout_s` after it are cancelled.
    Completed requests generate `max_tokens` tokens; disconnecting and giving-up ones ask for
    `long_max_tokens` so that they are cut mid-generation. Ranges are (low, high), inclusive.
    `model=None` asks the server for its model.
    """

    num_clients: int = bench_setting(400, "concurrent clients", name="clients")
    num_requests: int = bench_setting(
        2000, "generation requests of the measured phase", name="requests")
    time_limit_s: float = bench_setting(600.0, "no new request after this many seconds")
    request_timeout_s: float = 120.0
    max_tokens: int = bench_setting(8, "tokens of each completed request")
    long_max_tokens: int = 64
    prompt_chars: tuple[int, int] = (8, 96)
    job_turns: tuple[int, int] = (2, 5)
    job_appended_tokens: tuple[int, int] = (8, 32)
    tool_gap_s: tuple[float, float] = (0.05, 0.5)
    delete_job_share: float = 0.3
    disconnect_after_chunks: int = 2
    give_up_after_s: tuple[float, float] = (0.02, 0.3)
    mix: LoadMix = field(default_factory=LoadMix)
    model: str | None = None
    seed: int = bench_setting(0, "seed of the clients' choices")

    def __post_init__(self) -> None:
        if self.num_clients < 1 or self.num_requests < 0:
            raise ValueError("num_clients must be >= 1 and num_requests >= 0")
        if self.time_limit_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("time limits must be positive")
        if not 1 <= self.max_tokens <= self.long_max_tokens:
            raise ValueError("need 1 <= max_tokens <= long_max_tokens")
        for name in ("prompt_chars", "job_turns", "job_appended_tokens", "tool_gap_s",
                     "give_up_after_s"):
            low, high = getattr(self, name)
            if not 0 <= low <= high:
                raise ValueError(f"{name} must be a range 0 <= low <= high")
        if self.job_turns[0] < 1 or self.prompt_chars[0] < 1:
            raise ValueError("jobs need >= 1 turn and prompts >= 1 character")
        if not 0 <= self.delete_job_share <= 1 or self.disconnect_after_chunks < 1:
            raise ValueError("delete_job_share in [0, 1], disconnect_after_chunks >= 1")


@dataclass
class LoadTally:
    """What one phase sent and got; mutated by its clients (one event loop, no locks)."""

    sent: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    jobs: Counter[str] = field(default_factory=Counter)
    in_flight: int = 0
    peak_in_flight: int = 0
    wall_s: float = 0.0
    cut_at_time_limit: int = 0

    @property
    def num_sent(self) -> int:
        return sum(self.sent.values())

    @property
    def num_errors(self) -> int:
        return sum(self.errors.values())

    def to_dict(self) -> dict[str, Any]:
        return {"requests_sent": self.num_sent, "sent_by_kind": dict(self.sent),
                "outcomes": dict(self.outcomes), "errors": dict(self.errors),
                "jobs": dict(self.jobs), "peak_in_flight": self.peak_in_flight,
                "wall_s": round(self.wall_s, 2), "cut_at_time_limit": self.cut_at_time_limit}


class RequestBudget:
    """Hands out the phase's requests until they or its time run out."""

    def __init__(self, num_requests: int, deadline_s: float) -> None:
        self.remaining = num_requests
        self.deadline_s = deadline_s

    def exhausted(self) -> bool:
        return self.remaining == 0 or time.monotonic() >= self.deadline_s

    def take(self, count: int) -> int:
        if self.exhausted():
            return 0
        granted = min(count, self.remaining)
        self.remaining -= granted
        return granted

    def give_back(self, count: int) -> None:
        """Returns requests taken but not sent (a job cut short)."""
        self.remaining += count


class LoadGenerator:
    """Runs load phases against `base_url`; `name` makes its job ids unique on the server.
    Each `run` call owns its own HTTP client and tally."""

    def __init__(self, base_url: str, settings: LoadSettings, name: str = "load") -> None:
        self.base_url = base_url
        self.settings = settings
        self.name = name
        self._job_numbers = itertools.count()
        self.open_jobs: set[str] = set()

    async def run(self, num_requests: int | None = None) -> LoadTally:
        """One phase of `num_requests` (default: the settings') requests; returns its tally.
        Jobs a cut-off client left open are deleted before returning."""
        settings = self.settings
        budget = RequestBudget(settings.num_requests if num_requests is None else num_requests,
                               time.monotonic() + settings.time_limit_s)
        tally = LoadTally()
        limits = httpx.Limits(max_connections=settings.num_clients + 16,
                              max_keepalive_connections=settings.num_clients + 16)
        timeout = httpx.Timeout(settings.request_timeout_s, connect=30.0)
        started_s = time.monotonic()
        async with httpx.AsyncClient(base_url=self.base_url, limits=limits,
                                     timeout=timeout) as http:
            model = settings.model or await served_model(http)
            await self._run_clients(_Phase(self, http, tally, budget, model))
            for job_id in sorted(self.open_jobs):
                await delete_job(http, job_id)
            self.open_jobs.clear()
        tally.wall_s = time.monotonic() - started_s
        return tally

    async def _run_clients(self, phase: _Phase) -> None:
        """Runs the clients to the end of the budget; those still busy a request timeout
        after the time limit are cancelled and counted as cut off."""
        settings = self.settings
        tasks = [asyncio.create_task(phase.client(index))
                 for index in range(settings.num_clients)]
        done, pending = await asyncio.wait(
            tasks, timeout=settings.time_limit_s + settings.request_timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        phase.tally.cut_at_time_limit = len(pending)
        for task in done:
            if task.exception() is not None:
                phase.tally.errors[f"client crashed: {task.exception()!r}"] += 1

    def next_job_id(self) -> str:
        return f"{self.name}-{self.settings.seed}-{next(self._job_numbers)}"


class _Phase:
    """The clients of one phase and the scenarios they run."""

    def __init__(self, generator: LoadGenerator, http: httpx.AsyncClient, tally: LoadTally,
                 budget: RequestBudget, model: str) -> None:
        self.generator = generator
        self.model = model
        self.settings = generator.settings
        self.http = http
        self.tally = tally
        self.budget = budget
        self.scenarios: dict[str, Callable[[random.Random], Awaitable[None]]] = {
            "stream_completion": self._stream_completion, "completion": self._completion,
            "stream_chat": self._stream_chat, "chat": self._chat,
            "stream_disconnect": self._stream_disconnect, "give_up": self._give_up,
            "agent_job": self._agent_job,
        }

    async def client(self, index: int) -> None:
        """Client `index`: scenarios one after another (its own seeded choices) until the
        budget is spent."""
        rng = random.Random(f"{self.settings.seed}:{self.generator.name}:{index}")
        weights = self.settings.mix.weights()
        while not self.budget.exhausted():
            scenario = rng.choices(SCENARIOS, weights)[0]
            if scenario != "agent_job":
                self.budget.take(1)
            await self.scenarios[scenario](rng)

    # Scenarios

    async def _stream_completion(self, rng: random.Random) -> None:
        await self.send("stream_completion", "/v1/completions",
                        self._completion_body(rng, stream=True), stream=True)

    async def _completion(self, rng: random.Random) -> None:
        await self.send("completion", "/v1/completions",
                        self._completion_body(rng, stream=False), stream=False)

    async def _stream_chat(self, rng: random.Random) -> None:
        await self.send("stream_chat", "/v1/chat/completions",
                        self._chat_body(rng, stream=True), stream=True)

    async def _chat(self, rng: random.Random) -> None:
        await self.send("chat", "/v1/chat/completions", self._chat_body(rng, stream=False),
                        stream=False)

    async def _stream_disconnect(self, rng: random.Random) -> None:
        body = self._completion_body(rng, stream=True, max_tokens=self.settings.long_max_tokens)
        await self.send("stream_disconnect", "/v1/completions", body, stream=True,
                        cut_after_chunks=self.settings.disconnect_after_chunks)

    async def _give_up(self, rng: random.Random) -> None:
        use_chat = rng.random() < 0.5
        long_tokens = self.settings.long_max_tokens
        body = (self._chat_body(rng, stream=False, max_tokens=long_tokens) if use_chat
                else self._completion_body(rng, stream=False, max_tokens=long_tokens))
        path = "/v1/chat/completions" if use_chat else "/v1/completions"
        await self.send("give_up", path, body, stream=False,
                        give_up_after_s=rng.uniform(*self.settings.give_up_after_s))

    async def _agent_job(self, rng: random.Random) -> None:
        """Turns of one job; a job cut short (budget, error, 429) is deleted."""
        settings = self.settings
        num_turns = self.budget.take(rng.randint(*settings.job_turns))
        if num_turns == 0:
            return
        job_id = self.generator.next_job_id()
        end_by_delete = rng.random() < settings.delete_job_share
        self.generator.open_jobs.add(job_id)
        self.tally.jobs["started"] += 1
        prompt = _token_ids(rng, rng.randint(*settings.prompt_chars))
        for turn in range(num_turns):
            is_last = turn == num_turns - 1
            body = self._job_turn_body(job_id, prompt, stream=rng.random() < 0.5,
                                       is_last_step=is_last and not end_by_delete)
            reply = await self.send("agent_turn", "/v1/completions", body,
                                    stream=body["stream"])
            if reply.outcome != OK:
                self.budget.give_back(num_turns - turn - 1)
                await self._end_job(job_id, cut_short=True)
                return
            if not is_last:
                prompt = [*prompt, *reply.token_ids,
                          *_token_ids(rng, rng.randint(*settings.job_appended_tokens))]
                await asyncio.sleep(rng.uniform(*settings.tool_gap_s))
        if end_by_delete:
            await self._end_job(job_id, cut_short=False)
            return
        self.tally.jobs["ended_by_last_step"] += 1
        self.generator.open_jobs.discard(job_id)

    async def _end_job(self, job_id: str, *, cut_short: bool) -> None:
        """`DELETE`s the job. One cut short by a failed turn may be unknown to the engine
        (404: no turn of it finished); one that ran all its turns must be known."""
        status = await delete_job(self.http, job_id)
        self.generator.open_jobs.discard(job_id)
        if cut_short and status in (200, 404):
            self.tally.jobs["cut_short"] += 1
        elif not cut_short and status == 200:
            self.tally.jobs["ended_by_delete"] += 1
        else:
            self.tally.errors[f"DELETE job: {status or 'connection failed'}"] += 1

    # Bodies

    def _completion_body(self, rng: random.Random, *, stream: bool,
                         max_tokens: int | None = None) -> dict[str, Any]:
        tokens = max_tokens or self.settings.max_tokens
        return {"model": self.model, "prompt": self._text(rng), "stream": stream,
                **forced_length(tokens, stream)}

    def _chat_body(self, rng: random.Random, *, stream: bool,
                   max_tokens: int | None = None) -> dict[str, Any]:
        tokens = max_tokens or self.settings.max_tokens
        messages = [{"role": "system", "content": _SYSTEM_PROMPT},
                    {"role": "user", "content": self._text(rng)}]
        return {"model": self.model, "messages": messages, "stream": stream,
                **forced_length(tokens, stream)}

    def _job_turn_body(self, job_id: str, prompt: list[int], *, stream: bool,
                       is_last_step: bool) -> dict[str, Any]:
        return {"model": self.model, "prompt": prompt, "stream": stream,
                "return_token_ids": True, "job_id": job_id, "is_last_step": is_last_step,
                "tool_name": "bash", **forced_length(self.settings.max_tokens, stream)}

    def _text(self, rng: random.Random) -> str:
        """Printable text; half the prompts share a prefix, so the prefix cache serves
        them."""
        low, high = self.settings.prompt_chars
        body = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(
            rng.randint(low, high)))
        return rng.choice(_SHARED_PREFIXES) + body if rng.random() < 0.5 else body

    # Requests

    async def send(self, kind: str, path: str, body: dict[str, Any], *, stream: bool,
                   cut_after_chunks: int | None = None,
                   give_up_after_s: float | None = None) -> Reply:
        """Sends one generation request and tallies its outcome."""
        tally = self.tally
        tally.sent[kind] += 1
        tally.in_flight += 1
        tally.peak_in_flight = max(tally.peak_in_flight, tally.in_flight)
        try:
            reply = await exchange(self.http, path, body, stream=stream,
                                   cut_after_chunks=cut_after_chunks,
                                   give_up_after_s=give_up_after_s)
        except httpx.HTTPError as error:
            reply = Reply(ERROR, error=type(error).__name__)
        finally:
            tally.in_flight -= 1
        tally.outcomes[reply.outcome] += 1
        if reply.error is not None:
            tally.errors[f"{kind}: {reply.error}"] += 1
        return reply


def _token_ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(*_PRINTABLE_IDS) for _ in range(count)]
