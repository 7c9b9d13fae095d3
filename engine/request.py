"""Engine-side request state, owned by the scheduler from `add_request` until it finishes."""

from __future__ import annotations

import enum
import math

import msgspec

from engine.sampling_params import CacheBreakpoint, SamplingParams
from engine.tool_calls import ToolCallFormat

MAX_TOKEN_ID = 2**32 - 1


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Every status after PREEMPTED is a finished one."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


class FinishReason(enum.IntEnum):
    """Why a request finished, as reported to clients (`str()` gives the OpenAI spelling).

    Codes start at 1 so that every reason is truthy.
    """

    STOP = 1
    LENGTH = 2
    ABORT = 3

    def __str__(self) -> str:
        return self.name.lower()


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


INFERRED_JOB_ID_PREFIX = "~inferred/"


def is_inferred_job_id(job_id: str) -> bool:
    """Whether `job_id` is an inferred job's: it starts with `INFERRED_JOB_ID_PREFIX`, or, a
    tenant's, does after the tenant's name and `/`."""
    _, slash, rest = job_id.partition("/")
    return job_id.startswith(INFERRED_JOB_ID_PREFIX) or (
        bool(slash) and rest.startswith(INFERRED_JOB_ID_PREFIX))


class JobInfo(msgspec.Struct, frozen=True, kw_only=True):
    """The agent-job a request belongs to (one turn of one agent program).

    `tool_name` is the tool this turn is known to call, when the client says so. `inferred`:
    the client named no job and the scheduler inferred this one from the prompt
    (`engine.scheduler.job_inference`); only inferred jobs have ids that start with
    `INFERRED_JOB_ID_PREFIX`, after their tenant's name and `/` for a tenant's
    (`is_inferred_job_id`), so a client's job id never meets an inferred one.
    """

    job_id: str
    is_last_step: bool = False
    tool_name: str | None = None
    inferred: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.job_id, str) or not self.job_id:
            raise ValueError(f"job_id must be a non-empty string, got {self.job_id!r}")
        if self.tool_name is not None and not self.tool_name:
            raise ValueError("tool_name must be non-empty when given")
        if is_inferred_job_id(self.job_id) != self.inferred:
            raise ValueError(f"job ids starting with {INFERRED_JOB_ID_PREFIX!r} are reserved "
                             f"for inferred jobs, got job_id={self.job_id!r} with "
                             f"inferred={self.inferred}")


class Request:
    """One generation request as the scheduler tracks it.

    Token ids grow as outputs are appended; `num_computed_tokens` counts the tokens whose KV is
    computed (or scheduled to be computed in the step being built). `block_hashes` holds the
    chained hashes of the full blocks of `all_token_ids`, extended by the KV cache manager.
    `num_output_placeholders` counts output tokens scheduled to be sampled whose ids have not
    come back yet (0 or 1 between steps, up to 2 while the engine schedules a step before the
    previous one's tokens arrive: `SchedulerConfig.async_scheduling`); the KV of the first of
    them may be scheduled already, so `num_computed_tokens` may exceed `num_tokens` by as many.
    `num_cached_tokens` is the prefix-cache hit of the first admission (`None` before it);
    `first_scheduled_at_s` the time of that admission and `first_token_at_s` the end of the
    step that sampled the first output token, both on the scheduler's clock (`None` before).
    `tenant` is the tenant that sent the request (None without tenants): job inference never
    joins two tenants' turns, whether or not they share the prefix cache.
    `continues_request_id` is the finished request whose turn this one continues, when the
    frontend knows it (the client re-sent a tool call that request issued): job inference binds
    a request without a job to that turn's job first (`engine.scheduler.job_inference`).
    `tool_call_format` says how the frontend reads the output's tool calls when the request
    offers tools (None: it offers none, and a client that calls tools parses the text itself),
    so that the policy learns from the calls the client receives.
    """

    __slots__ = (
        "all_token_ids", "arrival_time_s", "block_hashes", "cache_salt", "continues_request_id",
        "eos_token_id",
        "first_scheduled_at_s", "first_token_at_s", "job", "num_cached_tokens",
        "num_computed_tokens", "num_output_placeholders", "num_preemptions", "num_prompt_tokens",
        "priority",
        "request_id", "sampling_params", "status", "stop_reason", "tenant", "tool_call_format",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        arrival_time_s: float,
        eos_token_id: int | None = None,
        priority: int = 0,
        job: JobInfo | None = None,
        cache_salt: str | None = None,
        tenant: str | None = None,
        continues_request_id: str | None = None,
        tool_call_format: ToolCallFormat | None = None,
    ) -> None:
        if not request_id:
            raise ValueError("request_id must be a non-empty string")
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if any(not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {MAX_TOKEN_ID}]")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if not isinstance(arrival_time_s, (int, float)) or not math.isfinite(arrival_time_s):
            raise ValueError(f"arrival_time_s must be a finite number, got {arrival_time_s!r}")
        cache_breakpoint = sampling_params.cache_breakpoint
        if (cache_breakpoint is not None
                and cache_breakpoint.num_prompt_tokens > len(prompt_token_ids)):
            raise ValueError(f"the cache breakpoint at token {cache_breakpoint.num_prompt_tokens} "
                             f"is past the prompt's {len(prompt_token_ids)} tokens")
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.arrival_time_s = arrival_time_s
        self.eos_token_id = eos_token_id
        self.priority = priority
        self.job = job
        self.cache_salt = cache_salt
        self.tenant = tenant
        self.continues_request_id = continues_request_id
        self.tool_call_format = tool_call_format
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.num_cached_tokens: int | None = None
        self.first_scheduled_at_s: float | None = None
        self.first_token_at_s: float | None = None
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        self.stop_reason: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def skips_prefix_cache(self) -> bool:
        """Whether admission must compute the whole prompt instead of reusing cached KV.

        Prompt logprobs come from the prompt's own forward pass, which a prefix-cache hit
        would skip. They are all returned by the step that samples the first token, so a
        request resumed after that reuses the cache again. The blocks such a request computes
        are cached for others as usual.
        """
        return self.sampling_params.prompt_logprobs is not None and self.num_output_tokens == 0

    @property
    def cache_breakpoint(self) -> CacheBreakpoint | None:
        """The prompt prefix the client asked to keep cached, and for how long (None: no ask;
        see `CacheBreakpoint`)."""
        return self.sampling_params.cache_breakpoint

    @property
    def job_id(self) -> str | None:
        return None if self.job is None else self.job.job_id

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)

    def append_output_token_id(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, job={self.job_id!r})"
        )
