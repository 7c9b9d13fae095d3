"""Flat engine arguments (the command-line flags and `LLM(...)` keywords) -> `EngineConfig`."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import UnionType
from typing import Literal, get_args, get_origin, get_type_hints

from engine.config import (
    AttentionBackendName,
    CacheConfig,
    Device,
    Dtype,
    EngineConfig,
    KVCacheDtype,
    LayerKernelsName,
    LoadFormat,
    ModelConfig,
    Quantization,
    SchedulerConfig,
    StructuredOutputConfig,
    TraceConfig,
)
from engine.executor.roofline import DEFAULT_SIM_PROFILE
from engine.executor.sim_profiles import get_sim_profile, sim_profile_names
from engine.model.directory import load_arch
from engine.model.tokenizer import tokenizer_dir
from engine.scheduler.options import option_items_to_dict
from engine.scheduler.registry import (
    POLICIES,
    check_policy_options,
    policy_options_help,
)

# What each flag means; `add_cli_args` appends the default (and argparse lists the choices).
_HELP = {
    "model": "'tiny' (the embedded default model) or a local Hugging Face directory",
    "tokenizer": "directory of the tokenizer files when the model's has none; None: the model's",
    "dtype": "dtype of weights and activations; auto: float32 on CPU, bfloat16 on CUDA",
    "load_format": "auto: read the weights; dummy: random weights from --seed",
    "device": "auto: CUDA when one is available, else CPU",
    "attention_backend": (
        "attention kernels: sdpa (torch, every device) | triton (paged kernels; CUDA, or CPU "
        "under TRITON_INTERPRET=1) | triton-sdpa (triton, with torch's SDPA for long prompts "
        "that have no cached prefix) | auto (triton-sdpa on CUDA where the kernels cover "
        "the model, else sdpa)"
    ),
    "layer_kernels": (
        "how the layers' norms, rotary and SiLU run: torch (ops) | triton (fused kernels; "
        "CUDA, or CPU under TRITON_INTERPRET=1) | auto (triton on CUDA, torch on CPU)"
    ),
    "enforce_eager": "run decode steps eagerly instead of replaying CUDA graphs",
    "quantization": (
        "none | fp8: the decoder layers' projection weights in float8 e4m3 (a scale per "
        "output channel), their inputs quantized per token (half the weight bytes, FP8 "
        "tensor cores; CUDA needs bfloat16 and a GPU with FP8, e.g. an H100)"
    ),
    "cpu_threads": (
        "torch's threads for a model on CPU; None: torch's count when the engine runs in the "
        "caller's process, one fewer (a core left to the frontend) in `serve`'s engine core "
        "process, unless OMP_NUM_THREADS is set"
    ),
    "leave_core_to_frontend": (
        "without --cpu-threads, give a model on CPU one thread fewer than torch's count (at "
        "least 1), leaving a core to a frontend beside it; None: `serve`'s engine core "
        "process does unless OMP_NUM_THREADS is set, an engine in the caller's process not"
    ),
    "seed": "seed of dummy weights and of unseeded sampling",
    "max_model_len": "longest sequence (prompt + output); None: the model's",
    "block_size": "tokens per KV block",
    "num_kv_blocks": "fix the KV pool size; None: sized from memory",
    "enable_prefix_caching": "reuse the KV of shared prompt prefixes",
    "gpu_memory_utilization": "fraction of GPU memory for weights, activations and KV",
    "cpu_kv_cache_space_gib": "KV pool size on CPU, GiB",
    "kv_cache_dtype": (
        "what the KV cache stores: auto (the model's dtype) | fp8 (float8 e4m3, scale 1: "
        "twice the blocks, half the attention reads, 3 mantissa bits; triton attention "
        "backend only)"
    ),
    "kv_offload_gib": (
        "host-memory KV tier, GiB: evictable KV is stored there and prefixes found there are "
        "loaded back (needs prefix caching); 0: off"
    ),
    "max_num_seqs": "most requests running at once",
    "max_num_batched_tokens": "token budget of one step",
    "long_prefill_token_threshold": "most tokens one request computes per step; None: no cap",
    "enable_chunked_prefill": "split long prompts across steps",
    "async_scheduling": (
        "schedule and launch each step before reading the previous step's tokens, so that "
        "the host's work overlaps the device's (no host KV tier); None: on for a model on "
        "CUDA without a host KV tier, off elsewhere"
    ),
    "scheduling_policy": f"{' | '.join(POLICIES)} | a module:Class path",
    "executor": "torch (run the model) | simulated (a cost model) | a module:Class path",
    "sim_profile": (
        f"cost profile of the simulated executor: {' | '.join(sim_profile_names())} | a "
        "measured profile's JSON file (continuum bench calibrate); None with --executor "
        f"simulated: {DEFAULT_SIM_PROFILE}"
    ),
    "policy_options": "KEY=VALUE setting of the scheduling policy, repeatable. Options by policy",
    "job_inference": (
        "give a request without a job the job of the recently finished turn its prompt "
        "continues, or a new inferred job"
    ),
    "job_inference_max_turns": "most finished turns job inference remembers",
    "job_inference_max_age_s": (
        "seconds a finished turn can be continued by job inference (and its pin lasts at most)"
    ),
    "trace_path": (
        "write a JSONL scheduler trace here (overwritten); None: $CONTINUUM_TRACE_PATH or "
        "$VLLM_SCHED_TRACE_PATH, else off"
    ),
    "trace_max_bytes": "stop tracing before the trace file passes this size; None: no limit",
    "grammar_cache_bytes": "most bytes of compiled grammars the engine core keeps for reuse",
    "max_grammar_bytes": "most bytes one grammar's compile may take (its request gets a 400)",
    "max_grammar_compile_s": "most seconds one grammar may take to compile (400 after)",
    "grammar_mask_budget_s": (
        "most seconds a step waits for a request's grammar mask (the request sits the step "
        "out), and the CPU seconds over which a mask is slow (3 slow masks fail the request)"
    ),
    "debug_check_invariants": (
        "check the scheduler and KV invariants after every step (slow; a violation stops the "
        "core with the failed check)"
    ),
}

TRACE_PATH_VARIABLES = ("CONTINUUM_TRACE_PATH", "VLLM_SCHED_TRACE_PATH")


@dataclass(frozen=True)
class EngineArgs:
    """Every engine setting as one flat, frozen record; see `_HELP` for each field.

    The defaults (and through them the flags' defaults) are the config dataclasses' own, read
    from their class attributes, so each default is stated once, in `engine.config`.
    """

    model: str = ModelConfig.model
    tokenizer: str | None = ModelConfig.tokenizer
    dtype: Dtype = ModelConfig.dtype
    load_format: LoadFormat = ModelConfig.load_format
    device: Device = ModelConfig.device
    attention_backend: AttentionBackendName = ModelConfig.attention_backend
    layer_kernels: LayerKernelsName = ModelConfig.layer_kernels
    enforce_eager: bool = ModelConfig.enforce_eager
    quantization: Quantization = ModelConfig.quantization
    cpu_threads: int | None = ModelConfig.cpu_threads
    leave_core_to_frontend: bool | None = ModelConfig.leave_core_to_frontend
    seed: int = ModelConfig.seed
    # ModelConfig's None, the model's own context length (`to_engine_config` reads it and
    # gives it to both configs); SchedulerConfig's fixed default is on purpose not used here.
    max_model_len: int | None = ModelConfig.max_model_len
    block_size: int = CacheConfig.block_size
    num_kv_blocks: int | None = CacheConfig.num_kv_blocks
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization
    cpu_kv_cache_space_gib: float = CacheConfig.cpu_kv_cache_space_gib
    kv_offload_gib: float = CacheConfig.kv_offload_gib
    kv_cache_dtype: KVCacheDtype = CacheConfig.kv_cache_dtype
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    long_prefill_token_threshold: int | None = SchedulerConfig.long_prefill_token_threshold
    enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill
    async_scheduling: bool | None = SchedulerConfig.async_scheduling
    scheduling_policy: str = SchedulerConfig.policy
    executor: str = EngineConfig.executor
    sim_profile: str | None = EngineConfig.sim_profile
    # Differs on purpose: KEY=VALUE items (as the flags give them) or a mapping, turned into
    # SchedulerConfig's str -> str dict; empty, like that dict's default.
    policy_options: tuple[str, ...] | Mapping[str, object] = ()
    job_inference: bool = SchedulerConfig.job_inference
    job_inference_max_turns: int = SchedulerConfig.job_inference_max_turns
    job_inference_max_age_s: float = SchedulerConfig.job_inference_max_age_s
    trace_path: str | None = TraceConfig.path
    trace_max_bytes: int | None = TraceConfig.max_bytes
    grammar_cache_bytes: int = StructuredOutputConfig.grammar_cache_bytes
    max_grammar_bytes: int = StructuredOutputConfig.max_grammar_bytes
    max_grammar_compile_s: float = StructuredOutputConfig.max_grammar_compile_s
    grammar_mask_budget_s: float = StructuredOutputConfig.grammar_mask_budget_s
    debug_check_invariants: bool = EngineConfig.debug_check_invariants

    def to_engine_config(self, environ: Mapping[str, str] = os.environ) -> EngineConfig:
        """The validated config; ValueError naming the bad field (or a model without tokenizer
        files and no `tokenizer`). Without `trace_path`, the first of `TRACE_PATH_VARIABLES`
        set (non-empty) in `environ` enables tracing."""
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = load_arch(self.model).max_position_embeddings
        tokenizer_dir(self.model, self.tokenizer)  # before any process starts
        if self.sim_profile is not None:
            get_sim_profile(self.sim_profile)
        return EngineConfig(
            model=ModelConfig(model=self.model, tokenizer=self.tokenizer, dtype=self.dtype,
                              load_format=self.load_format, max_model_len=max_model_len,
                              seed=self.seed, device=self.device,
                              attention_backend=self.attention_backend,
                              layer_kernels=self.layer_kernels,
                              enforce_eager=self.enforce_eager,
                              quantization=self.quantization,
                              cpu_threads=self.cpu_threads,
                              leave_core_to_frontend=self.leave_core_to_frontend),
            cache=CacheConfig(block_size=self.block_size, num_kv_blocks=self.num_kv_blocks,
                              enable_prefix_caching=self.enable_prefix_caching,
                              gpu_memory_utilization=self.gpu_memory_utilization,
                              cpu_kv_cache_space_gib=self.cpu_kv_cache_space_gib,
                              kv_offload_gib=self.kv_offload_gib,
                              kv_cache_dtype=self.kv_cache_dtype),
            scheduler=SchedulerConfig(
                max_model_len=max_model_len, max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                enable_chunked_prefill=self.enable_chunked_prefill,
                policy=self.scheduling_policy, policy_options=self._checked_policy_options(),
                job_inference=self.job_inference,
                job_inference_max_turns=self.job_inference_max_turns,
                job_inference_max_age_s=self.job_inference_max_age_s,
                async_scheduling=self.async_scheduling,
            ),
            trace=TraceConfig(path=self._trace_path(environ), max_bytes=self.trace_max_bytes),
            structured_output=StructuredOutputConfig(
                grammar_cache_bytes=self.grammar_cache_bytes,
                max_grammar_bytes=self.max_grammar_bytes,
                max_grammar_compile_s=self.max_grammar_compile_s,
                grammar_mask_budget_s=self.grammar_mask_budget_s,
            ),
            executor=self.executor,
            sim_profile=self.sim_profile,
            debug_check_invariants=self.debug_check_invariants,
        )

    def _checked_policy_options(self) -> dict[str, str]:
        options = self._policy_options()
        check_policy_options(self.scheduling_policy, options)
        return options

    def _policy_options(self) -> dict[str, str]:
        if isinstance(self.policy_options, Mapping):
            return {str(key): _option_text(value) for key, value in self.policy_options.items()}
        if isinstance(self.policy_options, str):
            raise ValueError("policy_options must be KEY=VALUE items or a mapping, not a string")
        return option_items_to_dict(self.policy_options)

    def _trace_path(self, environ: Mapping[str, str]) -> str | None:
        if self.trace_path is not None:
            return self.trace_path
        return next((environ[name] for name in TRACE_PATH_VARIABLES if environ.get(name)), None)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Adds one `--flag-name` per field (booleans also get `--no-...`)."""
        group = parser.add_argument_group("engine")
        hints = get_type_hints(EngineArgs)
        for spec in fields(EngineArgs):
            flag = "--" + spec.name.replace("_", "-")
            default = spec.default
            help_text = _HELP[spec.name].replace("%", "%%") + " (default: %(default)s)"
            if spec.name == "policy_options":
                options_help = policy_options_help(EngineArgs.scheduling_policy)
                help_text = f"{_HELP[spec.name]}: {options_help}"
                # A list, for argparse's append; `from_cli_args` makes it the default's tuple.
                group.add_argument("--policy-option", dest="policy_options", action="append",
                                   metavar="KEY=VALUE", default=[],
                                   help=help_text.replace("%", "%%"))
            elif isinstance(default, bool) or hints[spec.name] == bool | None:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                   help=help_text)
            else:
                group.add_argument(flag, type=_flag_type(hints[spec.name]), default=default,
                                   choices=_flag_choices(hints[spec.name]),
                                   help=help_text)

    @staticmethod
    def cli_flags(args: argparse.Namespace) -> list[str]:
        """The engine flags that reproduce `args` (parsed by `add_cli_args`), for a child
        process."""
        flags: list[str] = []
        for spec in fields(EngineArgs):
            value = getattr(args, spec.name, None)
            flag = "--" + spec.name.replace("_", "-")
            if value is None:
                continue
            if spec.name == "policy_options":
                flags += [item for option in value for item in ("--policy-option", option)]
            elif isinstance(value, bool):
                flags.append(flag if value else "--no-" + flag[2:])
            else:
                flags += [flag, str(value)]
        return flags

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        values = {spec.name: getattr(args, spec.name) for spec in fields(cls)}
        values["policy_options"] = tuple(values["policy_options"])
        return cls(**values)


def _option_text(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def _flag_type(hint: object) -> type:
    """int, float or str: what a flag's value is parsed as, from its field's type hint."""
    members = get_args(hint) if isinstance(hint, UnionType) else (hint,)
    for kind in (int, float):
        if kind in members:
            return kind
    return str


def _flag_choices(hint: object) -> tuple[str, ...] | None:
    """A `Literal` field's values (from `engine.config`). The simulated executor's profile
    has none: it also takes a file, which `EngineConfig` checks."""
    if get_origin(hint) is Literal:
        return get_args(hint)
    return None
