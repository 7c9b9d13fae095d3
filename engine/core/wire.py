"""Messages between the frontend and the engine core, as msgspec msgpack tagged unions.

Frontend -> core (`CoreInput`, on the input ROUTER/DEALER link): add a request, abort
requests, call a utility, shut down. Core -> frontend: `CoreHello` once on the input link (the
startup handshake), then `CoreEvent`s on the output PUSH/PULL link. Fields are append-only;
nothing is pickled.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from engine.outputs import EngineCoreOutput
from engine.request import JobInfo
from engine.sampling_params import SamplingParams
from engine.tool_calls import ToolCallFormat


class EngineCoreRequest(msgspec.Struct, tag="add", kw_only=True, omit_defaults=True):
    """One sequence to generate: the frontend has tokenized and validated it already.

    `arrival_time_s` is on the core's clock; `None` means the time the core received it.
    `tenant`, `continues_request_id`, `tool_call_format`: see `Request`.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    priority: int = 0
    job: JobInfo | None = None
    cache_salt: str | None = None
    tenant: str | None = None
    arrival_time_s: float | None = None
    continues_request_id: str | None = None
    tool_call_format: ToolCallFormat | None = None


class AbortRequests(msgspec.Struct, tag="abort"):
    """Finish these requests now (unknown or finished ids are ignored)."""

    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="utility", kw_only=True):
    """Call the named `EngineCore` utility (see `EngineCore.UTILITIES`); answered by a
    `UtilityResult` with the same `call_id`."""

    call_id: int
    method: str
    args: list[Any] = msgspec.field(default_factory=list)


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Stop the busy loop, release the executor and exit."""


CoreInput = EngineCoreRequest | AbortRequests | UtilityCall | Shutdown


class CoreReady(msgspec.Struct, tag="ready", kw_only=True):
    """Handshake: the core is built and serving; what it allocated."""

    num_kv_blocks: int
    vocab_size: int
    max_model_len: int


class CoreStartupFailed(msgspec.Struct, tag="startup_failed"):
    """Handshake: building the core failed; the process exits after sending this."""

    error: str


CoreHello = CoreReady | CoreStartupFailed


class EngineCoreOutputs(msgspec.Struct, tag="outputs", kw_only=True):
    """The per-request outputs of one step (or request rejections), stamped on the core's clock,
    with the core's queue as it stands after them: `num_waiting` requests wait, and
    `num_requests_received` is how many requests the core has been sent so far (so a client
    can count those still on their way). Sent with no outputs when only the queue changed."""

    outputs: list[EngineCoreOutput]
    timestamp_s: float
    num_waiting: int = 0
    num_requests_received: int = 0


class UtilityResult(msgspec.Struct, tag="utility_result", kw_only=True, omit_defaults=True):
    """The answer to the `UtilityCall` with `call_id`: its result, or the error it raised."""

    call_id: int
    result: Any = None
    error: str | None = None


class CoreFailed(msgspec.Struct, tag="core_failed"):
    """The busy loop died; the process exits after sending this."""

    error: str


CoreEvent = EngineCoreOutputs | UtilityResult | CoreFailed


class EngineStats(msgspec.Struct, kw_only=True):
    """A snapshot of the core: queue lengths, KV pool use, prefix cache, pins, step timings.

    Counters are cumulative since the core started (`pins_created` by source, `pins_released`
    and `jobs_ended` by reason; `num_jobs_created`: the jobs the policy started books for,
    `num_jobs_inferred`: those the scheduler inferred for requests that named none); times
    are seconds of wall time (`execute_time_s` inside the executor, of which `submit_time_s`
    submitting steps, on CUDA their launch, on a CPU their whole forward, and the rest
    taking their results; `step_time_s` in whole steps; `grammar_compile_time_s` is spent
    on the compile thread, off the step loop), but `grammar_mask_time_s`, CPU seconds of
    the mask workers computing structured outputs' token masks. With a host KV tier,
    `num_host_kv_blocks` (0: none) of which `num_used_host_kv_blocks` hold KV, the tokens
    stored to and loaded from it, and `prefix_cache_host_hit_tokens`, the part of
    `prefix_cache_hit_tokens` found there, and `kv_copy_time_s`, the part of
    `execute_time_s` steps waited for its copies. `recomputed_tokens` counts the tokens
    computed again after preemption: what each preemption dropped minus what the request's
    readmission found in the prefix cache (at least 0), as `trace summarize` counts them.
    `async_scheduling` says whether the core schedules each step before it reads the last
    one's tokens (the resolved `SchedulerConfig.async_scheduling`).
    """

    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_blocks: int
    kv_usage: float
    num_pins: int
    num_pinned_blocks: int
    num_preemptions: int
    recomputed_tokens: int = 0
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    num_steps: int
    step_time_s: float
    execute_time_s: float
    submit_time_s: float = 0.0
    num_pins_created: int = 0
    num_cpu_threads: int | None = None  # torch's intra-op threads of a model on CPU
    pins_released: dict[str, int] = msgspec.field(default_factory=dict)
    num_jobs: int = 0
    num_jobs_created: int = 0
    num_jobs_inferred: int = 0
    jobs_ended: dict[str, int] = msgspec.field(default_factory=dict)
    pins_created: dict[str, int] = msgspec.field(default_factory=dict)
    num_invariant_checks: int = 0
    num_grammar_compiles: int = 0
    num_grammar_cache_hits: int = 0
    grammar_compile_time_s: float = 0.0
    grammar_mask_time_s: float = 0.0
    num_host_kv_blocks: int = 0
    num_used_host_kv_blocks: int = 0
    host_kv_stored_tokens: int = 0
    host_kv_loaded_tokens: int = 0
    prefix_cache_host_hit_tokens: int = 0
    kv_copy_time_s: float = 0.0
    async_scheduling: bool = False


class PinState(msgspec.Struct, kw_only=True):
    """A live pin as clients see it: the turn it holds, its blocks, its TTL (seconds), and
    who asked for it (the policy, or the client's `cache_control` breakpoint)."""

    request_id: str
    num_blocks: int
    ttl_s: float
    remaining_ttl_s: float
    source: Literal["policy", "client"] = "policy"


class JobState(msgspec.Struct, kw_only=True):
    """What the core holds for one job: its unfinished turns, its pin, and the policy's books
    on it (None under policies that keep none)."""

    job_id: str
    num_unfinished_requests: int
    pin: PinState | None = None
    policy: dict[str, Any] | None = None
