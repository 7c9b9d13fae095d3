"""Frozen configuration objects, one per concern, validated on construction.

Configs are never mutated after construction; derive a new one with `dataclasses.replace`.
Every invalid value raises `ValueError` naming the field, so a bad flag or API argument fails
before any engine state exists. A field a user sets carries `setting` metadata (help, group,
flat name): `EngineArgs`, the flags of `continuum serve` and the keys of its `--config` file
are made from it (`engine.engine_args.flags`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from tracing.files import check_replaceable
from tracing.writer import MIN_MAX_BYTES, TRACE_FILE_PREFIX

# The sections of `continuum serve --help`, in its order.
SettingGroup = Literal["model", "cache", "scheduling", "server", "replicas", "observability",
                       "bench", "policy"]
# A policy option's value: text as a flag gives it, or typed as a config file or `LLM(...)`
# gives it; the policy converts either (`engine.scheduler.options`).
PolicyOptionValue = str | bool | int | float | tuple[str, ...]


def setting(help: str, *, group: SettingGroup, flag: bool = True, name: str | None = None,
            option: str | None = None, metavar: str | None = None,
            choices: Iterable[str] | None = None,
            default_text: str | None = None) -> dict[str, Any]:
    """The metadata of a dataclass field that a user sets. `help` is its line in `--help`
    (which appends the default unless it is None); `group` its section there; `flag=False`
    keeps it off the command line, a key of the `--config` file only (settings for
    experiments); `name` is its flat name (file key, `EngineArgs` keyword, flag) where the
    field's own would be unclear outside its class; `option` its flag where that is not
    the name's (a repeatable flag's singular); `metavar` names its value in `--help`;
    `choices` are the values of a `str` field that a registry checks (a `Literal` field's
    are its own); `default_text` states a default that depends on the machine."""
    return {"help": help, "group": group, "flag": flag, "name": name, "option": option,
            "metavar": metavar, "choices": None if choices is None else tuple(choices),
            "default_text": default_text}


# Bounds on sizes no machine reaches, so that a mistyped one is refused with its name at start
# rather than failing an allocation (or a numpy shape) deep in the engine core.
MAX_MODEL_LEN = 1 << 24  # tokens
MAX_NUM_SEQS = 1 << 16
MAX_NUM_KV_BLOCKS = 1 << 28
MAX_MEMORY_GIB = 1 << 20  # a pebibyte


def _require_positive(name: str, value: int | None, at_most: int | None = None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if value is not None and at_most is not None and value > at_most:
        raise ValueError(f"{name} must be at most {at_most:,}, got {value:,}")


def policy_option_value(key: object, value: object) -> PolicyOptionValue:
    """`value` of policy option `key` as the engine carries it (strings of a list as a
    tuple); ValueError for anything else."""
    if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        return tuple(value)
    if isinstance(value, (str, bool, int, float)):
        return value
    raise ValueError(f"policy option {key!r} must be a string, boolean, number or array of "
                     f"strings, got {value!r}")


def _require_choice(name: str, value: object, allowed: object) -> None:
    """`allowed` is a `Literal` type; its values are the choices (the CLI reads them too)."""
    choices = get_args(allowed)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


KVCacheDtype = Literal["auto", "fp8"]


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache layout.

    `num_kv_blocks` fixes the pool size; `None` lets the model runner size it: on CUDA from
    the device memory it profiles (`gpu_memory_utilization` of the total), on CPU from
    `cpu_kv_cache_space_gib`. `kv_offload_gib` > 0 adds a host-memory tier of that many GiB
    (0: none), which evictable KV is stored to and prefixes are loaded back from; it needs
    prefix caching. `kv_cache_dtype` is what the cache stores: `auto` the model's dtype,
    `fp8` float8 e4m3 with a scale of 1 (one byte a value: twice the blocks in the same
    memory and half the bytes attention reads, at the precision of 3 mantissa bits; values
    beyond +-448 saturate), which the triton attention backend reads and no host tier takes.
    """

    block_size: int = field(default=16, metadata=setting("tokens per KV block", group="cache"))
    num_kv_blocks: int | None = field(default=None, metadata=setting(
        "KV pool size in blocks (default: from memory)", group="cache"))
    enable_prefix_caching: bool = field(default=True, metadata=setting(
        "reuse cached prompt prefixes", group="cache"))
    gpu_memory_utilization: float = field(default=0.9, metadata=setting(
        "share of GPU memory to use", group="cache", metavar="F"))
    cpu_kv_cache_space_gib: float = field(default=2.0, metadata=setting(
        "KV pool size on CPU", group="cache", metavar="GIB"))
    kv_offload_gib: float = field(default=0.0, metadata=setting(
        "host-memory KV tier; 0: none", group="cache", metavar="GIB"))
    kv_cache_dtype: KVCacheDtype = field(default="auto", metadata=setting(
        "fp8: twice the blocks, 3 mantissa bits (triton attention)", group="cache"))

    def __post_init__(self) -> None:
        _require_positive("block_size", self.block_size)
        _require_choice("kv_cache_dtype", self.kv_cache_dtype, KVCacheDtype)
        _require_positive("num_kv_blocks", self.num_kv_blocks, MAX_NUM_KV_BLOCKS)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if not 0 < self.cpu_kv_cache_space_gib <= MAX_MEMORY_GIB:
            raise ValueError(f"cpu_kv_cache_space_gib must be in (0, {MAX_MEMORY_GIB:,}] GiB, "
                             f"got {self.cpu_kv_cache_space_gib!r}")
        if not 0 <= self.kv_offload_gib <= MAX_MEMORY_GIB:
            raise ValueError(f"kv_offload_gib must be in [0, {MAX_MEMORY_GIB:,}] GiB, got "
                             f"{self.kv_offload_gib!r}")
        if self.kv_offload_gib and not self.enable_prefix_caching:
            raise ValueError("kv_offload_gib needs prefix caching (the host tier is keyed by "
                             "block hashes)")
        if self.kv_offload_gib and self.kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} does not combine with a "
                             "host tier (kv_offload_gib) yet: the tier's block copies use "
                             "index ops that torch lacks for float8")


@dataclass(frozen=True)
class SchedulerConfig:
    """Token budget and batching limits of one scheduler step (vLLM V1 semantics).

    - `max_num_batched_tokens`: the unified token budget per step (prefill and decode tokens).
    - `max_num_seqs`: at most this many requests are RUNNING at once.
    - `max_model_len`: the longest sequence (prompt + output tokens) a request may reach.
    - `long_prefill_token_threshold`: a request computes at most this many tokens per step
      (`None`: no cap beyond the budget).
    - `enable_chunked_prefill`: a prompt may be split across steps; when off, a prompt must fit
      the budget whole.
    - `policy`: the scheduling policy, a registry name or a `module:Class` path.
    - `policy_options`: the policy's own settings as `KEY: VALUE` (`PolicyOptionValue`: text
      from flags, typed from a config file), carried without interpretation; the policy
      converts and validates them when it is built (`engine.scheduler.options`).
    - `job_inference`: a request without a job joins the job of the recently finished turn
      its prompt continues, or starts a new inferred job (`engine.scheduler.job_inference`).
    - `job_inference_max_turns`, `job_inference_max_age_s`: bounds of the table of recently
      finished turns that inference matches against (oldest dropped first); a turn older than
      the age (seconds) is not continued, and an inferred job's pin lasts no longer.
    - `async_scheduling`: the engine core schedules and launches step N+1 before it reads
      step N's sampled tokens, so the host's work between steps overlaps the device's. A
      running request is scheduled on a placeholder for its token still on the device; a
      request that step N finishes has one token computed in step N+1 for nothing. Steps of
      requests with a structured output wait for the tokens first (their next mask needs
      them). None: on where the executor prefers it (a model on CUDA, whose steps run while
      the host goes on: `Executor.prefers_async_scheduling`) unless there is a host KV tier,
      off elsewhere.
    """

    # Not a setting of its own: the engine gives it the model's (`ModelConfig.max_model_len`).
    max_model_len: int = 2048
    max_num_batched_tokens: int = field(default=2048, metadata=setting(
        "token budget of one step", group="scheduling"))
    max_num_seqs: int = field(default=256, metadata=setting(
        "most requests running at once", group="scheduling"))
    long_prefill_token_threshold: int | None = field(default=None, metadata=setting(
        "tokens per step per request (default: no cap)", group="scheduling"))
    enable_chunked_prefill: bool = field(default=True, metadata=setting(
        "split long prompts across steps", group="scheduling"))
    policy: str = field(default="continuum", metadata=setting(
        "the scheduling policy", group="scheduling", name="scheduling_policy", metavar="NAME"))
    policy_options: dict[str, PolicyOptionValue] = field(default_factory=dict, metadata=setting(
        "an option of the scheduling policy (repeatable)", group="scheduling",
        option="--policy-option", metavar="KEY=VALUE"))
    job_inference: bool = field(default=True, metadata=setting(
        "infer missing job ids", group="scheduling"))
    job_inference_max_turns: int = field(default=16384, metadata=setting(
        "finished turns it remembers", group="scheduling"))
    job_inference_max_age_s: float = field(default=300.0, metadata=setting(
        "seconds a turn is remembered", group="scheduling", metavar="S"))
    async_scheduling: bool | None = field(default=None, metadata=setting(
        "overlap host and device work (default: on for CUDA without a host KV tier)",
        group="scheduling"))

    def __post_init__(self) -> None:
        _require_positive("max_model_len", self.max_model_len, MAX_MODEL_LEN)
        _require_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _require_positive("max_num_seqs", self.max_num_seqs, MAX_NUM_SEQS)
        _require_positive("long_prefill_token_threshold", self.long_prefill_token_threshold)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
        if self.long_prefill_token_threshold is not None and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold requires enable_chunked_prefill")
        if not self.policy:
            raise ValueError("policy must be a non-empty name")
        for key, value in self.policy_options.items():
            if not (isinstance(key, str) and key) or policy_option_value(key, value) != value:
                raise ValueError(f"policy_options must map names to strings, booleans, "
                                 f"numbers or tuples of strings, got {self.policy_options!r}")
        _require_positive("job_inference_max_turns", self.job_inference_max_turns)
        if not 0 < self.job_inference_max_age_s < math.inf:
            raise ValueError("job_inference_max_age_s must be a positive finite number, got "
                             f"{self.job_inference_max_age_s!r}")


# The closed sets of ModelConfig; `typing.get_args` lists the values (the CLI's choices).
Dtype = Literal["auto", "float32", "float16", "bfloat16"]
LoadFormat = Literal["auto", "dummy"]
Device = Literal["auto", "cpu", "cuda"]
AttentionBackendName = Literal["auto", "sdpa", "triton", "triton-sdpa"]
LayerKernelsName = Literal["auto", "torch", "triton"]
Quantization = Literal["none", "fp8"]


@dataclass(frozen=True)
class ModelConfig:
    """Which model to run and how to load it.

    `model` is a local Hugging Face directory or `"tiny"` (the embedded default model).
    `tokenizer` is the directory of the tokenizer files (or `"tiny"`) when they are not with
    the weights (None: the model's directory).
    `max_model_len=None` takes the model's own context length. `dtype="auto"` is float32 on
    CPU and bfloat16 on CUDA; `device="auto"` is CUDA when one is available. `seed` draws the
    weights of `tiny` and of `load_format="dummy"`, and the sampling of unseeded requests.
    `attention_backend` names the attention kernels (`engine.model.attention`);
    `layer_kernels` how the layers' norms, rotary and SiLU run: `torch` ops, or `triton`'s
    fused kernels (`engine.model.layer_kernels`; CUDA, or CPU under Triton's interpreter);
    `auto` is triton on CUDA when Triton is installed, else torch;
    `enforce_eager` turns CUDA graphs off (decode steps then launch every kernel).
    `quantization="fp8"` stores the decoder layers' projection weights in float8 e4m3, one
    scale per output channel, quantized once after loading, and quantizes their inputs per
    token at each call (`engine.model.fp8_linear`; on CUDA, bfloat16 on a GPU with FP8 tensor
    cores); the embeddings, norms and LM head keep `dtype`.
    `cpu_threads` is torch's intra-op threads for the model on CPU (None: torch's count, or
    with `leave_core_to_frontend` one fewer, at least 1; None there means the client that
    starts a core process turns it on unless `OMP_NUM_THREADS` is set, and an engine in the
    caller's process does not: `engine.core.cpu_threads`).
    """

    model: str = field(default="tiny", metadata=setting(
        "'tiny', a catalogued model or a Hugging Face directory", group="model",
        metavar="NAME"))
    tokenizer: str | None = field(default=None, metadata=setting(
        "tokenizer directory (default: the model's)", group="model",
        metavar="DIR"))
    dtype: Dtype = field(default="auto", metadata=setting(
        "auto: bfloat16 on CUDA, float32 on CPU", group="model"))
    load_format: LoadFormat = field(default="auto", metadata=setting(
        "dummy: random weights", group="model"))
    max_model_len: int | None = field(default=None, metadata=setting(
        "longest sequence (default: the model's)", group="model"))
    seed: int = field(default=0, metadata=setting(
        "seed of dummy weights and of unseeded sampling", group="model"))
    device: Device = field(default="auto", metadata=setting(
        "auto: CUDA if there is one", group="model"))
    attention_backend: AttentionBackendName = field(default="auto", metadata=setting(
        "auto: triton-sdpa on CUDA if it covers the model, else sdpa", group="model"))
    layer_kernels: LayerKernelsName = field(default="auto", metadata=setting(
        "norms, rotary, SiLU; auto: triton on CUDA, else torch", group="model"))
    enforce_eager: bool = field(default=False, metadata=setting(
        "decode without CUDA graphs", group="model"))
    quantization: Quantization = field(default="none", metadata=setting(
        "fp8: float8 projections (bfloat16 on a GPU with FP8)", group="model"))
    cpu_threads: int | None = field(default=None, metadata=setting(
        "torch threads on CPU (default: torch's; one fewer in serve)", group="model"))
    leave_core_to_frontend: bool | None = field(default=None, metadata=setting(
        "without cpu_threads, one thread fewer than torch's count for a model on CPU "
        "(default: in serve's engine core process unless OMP_NUM_THREADS is set)",
        group="model", flag=False))

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must be a non-empty name or path")
        if self.tokenizer == "":
            raise ValueError("tokenizer must be a directory (or None for the model's)")
        _require_choice("dtype", self.dtype, Dtype)
        _require_choice("load_format", self.load_format, LoadFormat)
        _require_positive("max_model_len", self.max_model_len, MAX_MODEL_LEN)
        _require_choice("device", self.device, Device)
        _require_choice("attention_backend", self.attention_backend, AttentionBackendName)
        _require_choice("layer_kernels", self.layer_kernels, LayerKernelsName)
        _require_choice("quantization", self.quantization, Quantization)
        _require_positive("cpu_threads", self.cpu_threads)


@dataclass(frozen=True)
class TraceConfig:
    """Scheduler tracing (docs/architecture.md, 'Tracing'): off when `path` is None.

    - `path`: the JSONL trace file, overwritten at start.
    - `max_bytes`: stop writing (with a final `truncated` record) before the file passes it.
    """

    path: str | None = field(default=None, metadata=setting(
        "JSONL scheduler trace file (default: $CONTINUUM_TRACE_PATH)",
        group="observability", name="trace_path", metavar="PATH"))
    max_bytes: int | None = field(default=None, metadata=setting(
        "stop tracing before the file passes this", group="observability",
        name="trace_max_bytes", metavar="BYTES"))

    def __post_init__(self) -> None:
        if self.path == "":
            raise ValueError("trace_path must be a file path")
        if self.path is not None:
            check_replaceable(self.path, setting="trace_path",
                              own_prefixes=(TRACE_FILE_PREFIX,), devices=True,
                              folder_may_be_made=True)
        _require_positive("trace_max_bytes", self.max_bytes)
        if self.max_bytes is not None and self.max_bytes < MIN_MAX_BYTES:
            raise ValueError(
                f"trace_max_bytes must be at least {MIN_MAX_BYTES}, got {self.max_bytes}"
            )


@dataclass(frozen=True)
class StructuredOutputConfig:
    """What grammars may cost the engine core (docs/architecture.md, 'Structured outputs').

    - `grammar_cache_bytes`: most bytes of compiled grammars kept for reuse (each measured
      as the heap its compile allocated; least recently used first out).
    - `max_grammar_bytes`: most bytes one grammar's compile may allocate (its request fails).
    - `max_grammar_compile_s`: most seconds a compile may take (its request fails then).
    - `grammar_mask_budget_s`: most seconds a step waits for a request's mask (the request
      sits the step out), and the CPU seconds above which a mask counts as slow (three
      slow masks fail the request).
    """

    grammar_cache_bytes: int = field(default=512 << 20, metadata=setting(
        "bytes of compiled grammars kept", group="server"))
    max_grammar_bytes: int = field(default=64 << 20, metadata=setting(
        "most memory a grammar may compile in", group="server"))
    max_grammar_compile_s: float = field(default=10.0, metadata=setting(
        "seconds a grammar may compile", group="server", metavar="S"))
    grammar_mask_budget_s: float = field(default=0.01, metadata=setting(
        "seconds a step awaits a mask", group="server", metavar="S"))

    def __post_init__(self) -> None:
        _require_positive("grammar_cache_bytes", self.grammar_cache_bytes)
        _require_positive("max_grammar_bytes", self.max_grammar_bytes)
        for name in ("max_grammar_compile_s", "grammar_mask_budget_s"):
            value = getattr(self, name)
            if not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine instance needs; the cross-field checks live here.

    `executor` names what runs the steps: `"torch"` (the real model), `"simulated"` (a
    cost model: the profile `sim_profile` names, or a measured profile's JSON file, checked
    by `EngineArgs` and by the executor) or a `module:Class` path.
    `debug_check_invariants` makes the core check the scheduler and KV invariants after every
    step (for soak runs; an AssertionError stops the core).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    structured_output: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
    executor: str = field(default="torch", metadata=setting(
        "torch (run the model), simulated (a cost model) or a module:Class path",
        group="model", flag=False))
    sim_profile: str | None = field(default=None, metadata=setting(
        "the simulated executor's cost profile: a profile's name or a measured profile's "
        "JSON file (default: h100-llama3.1-8b)", group="model", flag=False))
    debug_check_invariants: bool = field(default=False, metadata=setting(
        "check invariants every step", group="observability"))

    def __post_init__(self) -> None:
        if not self.executor:
            raise ValueError("executor must be a non-empty name")
        if self.sim_profile is not None and self.executor != "simulated":
            raise ValueError("sim_profile applies only to the simulated executor")
        if self.executor == "simulated" and self.cache.kv_cache_dtype != "auto":
            raise ValueError(f"the simulated executor prices a KV cache of the profile's dtype, "
                             f"not kv_cache_dtype {self.cache.kv_cache_dtype!r}")
        if self.executor == "simulated" and self.model.quantization != "none":
            raise ValueError(f"the simulated executor prices the profile's weights, not "
                             f"quantization {self.model.quantization!r}")
        if self.scheduler.async_scheduling and self.cache.kv_offload_gib:
            raise ValueError("async_scheduling does not work with a host KV tier "
                             "(kv_offload_gib) yet: a step's tier copies are completed when "
                             "its tokens are read, which async scheduling defers")
        model_len = self.model.max_model_len
        if model_len is not None and model_len != self.scheduler.max_model_len:
            raise ValueError(
                f"model max_model_len ({model_len}) disagrees with the scheduler's "
                f"({self.scheduler.max_model_len})"
            )
        num_blocks = self.cache.num_kv_blocks
        if num_blocks is not None:
            check_pool_fits_one_sequence(num_blocks, self.cache.block_size,
                                         self.scheduler.max_model_len)


def check_pool_fits_one_sequence(num_blocks: int, block_size: int, max_model_len: int) -> None:
    """A pool that cannot hold one `max_model_len` sequence could wedge a lone request forever."""
    if num_blocks * block_size < max_model_len:
        raise ValueError(
            f"the KV pool ({num_blocks} blocks x {block_size} tokens) cannot hold one sequence "
            f"of max_model_len={max_model_len} tokens; add blocks or lower max_model_len"
        )
