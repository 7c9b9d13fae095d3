"""`python -m lab forward`: model steps through the model runner at fixed shapes.

Every step is a `SchedulerOutput` given to `ModelRunner.execute_model`, so what is timed is what
the engine runs: input preparation, attention metadata, the forward (a CUDA-graph replay for
decode steps where the attention backend allows it, unless `--enforce-eager`), logits and
sampling on the device, and the one copy of the sampled ids to the host. The scheduler itself is
not run: steps are built here.

- Decode shapes (`--decode BATCHxCONTEXT ...`): the prompts are prefilled first in steps of at
  most `--max-num-batched-tokens` tokens (untimed); then `--decode-steps` single-token steps are
  run once to warm up and `--repeats` times timed, each timed run continuing the sequences
  (contexts grow by `decode_steps` a run). Reported: the median run's milliseconds a step and
  output tokens a second. With async scheduling (`--async-scheduling`, by default on CUDA as
  in the engine core) each decode step is launched before the previous step's tokens are
  read, so the host's work of a step overlaps the device's; a run then ends when its last
  step's tokens are read.
  With `--profile`, one more run of `--decode-steps` steps under the torch profiler gives the
  kernel launches, the device's busy time, the host's time and the device's idle time
  (before its first kernel, between kernels, after its last) a step (`eval.step_profile`)
  and prints the kernels that took the most device time and the operators that took the
  most host time; so does one more prefill run. Then runs of their own (4 steps at least,
  as sampling slows the host) sample the host's Python (`lab.host_stacks`: the time
  between operators too, by innermost function and by the engine's line).
- Prefill shapes (`--prefill BATCHxTOKENS ...`): BATCH fresh prompts of TOKENS tokens in one
  step, once to warm up, then `--repeats` times timed. Reported: milliseconds and prompt tokens
  a second of the median. `BATCHxTOKENSxSTEPS` times STEPS such steps back to back, each of
  fresh prompts: with async scheduling each is launched before the previous one's tokens are
  read, as the engine core runs consecutive prefill steps, so a step's host work (input
  preparation, launches, the read of its token) overlaps the device's work of the step before.
  Reported: milliseconds a step and prompt tokens a second of the median run.
- Extend shapes (`--extend BATCHxTOKENS@CONTEXT[+DECODESxDCONTEXT] ...`): an agent's next
  turn, BATCH chunks of TOKENS new tokens, each over CONTEXT tokens already in the cache.
  The contexts are prefilled once (untimed); every run then sends new requests over the
  same prompts and blocks that arrive with the CONTEXT tokens computed, as a prefix-cache
  hit does, and times their one step: once to warm up, then `--repeats` times. With
  `+DECODESxDCONTEXT` the turn arrives while DECODES other requests decode (prompts of
  DCONTEXT tokens, prefilled untimed): each timed step also schedules a token of each, as
  a serving step does when a turn arrives. Reported: milliseconds and new tokens (chunks'
  and decodes') a second of the median.

Weights are random (`load_format="dummy"`; timing does not depend on their values) and prompts
are random token ids, so `--config FILE` (a Hugging Face `config.json`) measures any model's
shapes without its files. A shape that runs out of device memory, or needs more positions than
the model has, is reported as such and the others still run. The markdown table (stdout,
`--markdown FILE`) and the JSON (`--json FILE`) name the device, the torch and triton versions,
the dtype and the attention backend.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args

import numpy as np
import torch

from engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from engine.engine_args import EngineArgs
from engine.engine_args.flags import add_flags
from engine.model.directory import load_arch
from engine.outputs import PendingStep
from engine.sampling_params import SamplingParams
from engine.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from engine.structured_output.bitmask import GrammarBitmask
from engine.worker.model_runner import ModelRunner
from eval.report import write_json_report, write_report
from eval.step_profile import StepProfile, profile_steps
from lab.host_stacks import HostStacks

ShapeKind = Literal["decode", "prefill", "extend"]
# What the shape's requests ask of the sampler (`SAMPLINGS`); `grammar` also constrains
# every sampling row by a bitmask, as structured outputs do.
SamplingName = Literal["greedy", "random", "nucleus", "seeded", "penalties", "grammar"]
_T = TypeVar("_T")
# Steps (at least) whose host Python `--profile` samples, in runs of their own after the
# profiled one: a one-step shape's single step gives too few samples.
_SAMPLED_STEPS = 4
# More sampled runs follow while the sampler holds fewer samples than this, for at most
# `_MAX_SAMPLING_S` seconds: on a loaded CPU its thread may not run at all during a few
# milliseconds' steps. Decode runs grow their sequences, so at most `_MAX_SAMPLED_DECODE_RUNS`
# are sampled (their blocks are given up front); prefill runs are fresh.
_MIN_HOST_SAMPLES = 20
_MAX_SAMPLED_DECODE_RUNS = 4
_MAX_SAMPLING_S = 2.0


@dataclass(frozen=True)
class Shape:
    """`batch_size` sequences of `seq_len` tokens: decode steps after a cached context of
    `seq_len` tokens, prefill steps of `seq_len`-token prompts (`num_steps` of them back to
    back, each of fresh prompts), or a step of `seq_len`-token chunks each over
    `context_len` cached tokens (extend), beside a decode token of each of `decodes_beside`
    other requests, whose prompts have `decode_context_len` tokens."""

    kind: ShapeKind
    batch_size: int
    seq_len: int
    num_steps: int = 1
    context_len: int = 0
    sampling: SamplingName = "greedy"
    decodes_beside: int = 0
    decode_context_len: int = 0

    @classmethod
    def parse(cls, kind: ShapeKind, text: str) -> Shape:
        """`BATCHxTOKENS`, e.g. `32x1024`; for prefill also `BATCHxTOKENSxSTEPS`; for extend
        `BATCHxTOKENS@CONTEXT`, e.g. `1x256@30000`, or with decodes beside the chunks
        `BATCHxTOKENS@CONTEXT+DECODESxDCONTEXT`, e.g. `1x256@8000+32x1024`."""
        if kind == "extend":
            chunks, plus, beside = text.partition("+")
            shape, _, context = chunks.partition("@")
            fields = shape.lower().split("x")
            beside_fields = beside.lower().split("x") if plus else ["0", "0"]
            if not (context.isdigit() and int(context) > 0 and len(fields) == 2
                    and all(field.isdigit() and int(field) > 0 for field in fields)
                    and len(beside_fields) == 2 and all(map(str.isdigit, beside_fields))
                    and (not plus or min(map(int, beside_fields)) > 0)):
                raise argparse.ArgumentTypeError(
                    f"extend shape must be BATCHxTOKENS@CONTEXT[+DECODESxDCONTEXT], got {text!r}")
            decodes, decode_context = map(int, beside_fields)
            return cls("extend", *map(int, fields), context_len=int(context),
                       decodes_beside=decodes, decode_context_len=decode_context)
        fields = text.lower().split("x")
        max_fields = 3 if kind == "prefill" else 2
        if not (2 <= len(fields) <= max_fields
                and all(field.isdigit() and int(field) > 0 for field in fields)):
            usage = "BATCHxTOKENS[xSTEPS]" if kind == "prefill" else "BATCHxTOKENS"
            raise argparse.ArgumentTypeError(f"{kind} shape must be {usage}, got {text!r}")
        return cls(kind, *map(int, fields))

    @property
    def label(self) -> str:
        sampling = "" if self.sampling == "greedy" else f", {self.sampling} sampling"
        if self.kind == "decode":
            return f"decode, batch {self.batch_size}, context {self.seq_len:,}{sampling}"
        if self.kind == "extend":
            beside = (f", beside {self.decodes_beside} decodes at {self.decode_context_len:,}"
                      if self.decodes_beside else "")
            return (f"extend {self.batch_size} x {self.seq_len:,} over {self.context_len:,} "
                    f"cached{beside}{sampling}")
        label = f"prefill {self.batch_size} x {self.seq_len:,}"
        if self.num_steps > 1:
            label = f"{label}, {self.num_steps} steps back to back"
        return label + sampling


@dataclass(frozen=True)
class ShapeResult:
    """The median timed run of one shape; `error` (and no figures) when it could not run."""

    shape: Shape
    step_ms: float | None = None
    tokens_per_s: float | None = None
    error: str | None = None
    profile: StepProfile | None = None

    def to_json(self) -> dict[str, Any]:
        profile = None
        if self.profile is not None:
            profile = {key: value for key, value in asdict(self.profile).items()
                       if key not in ("top_kernels", "top_host_ops", "host_stacks")}
        return {**asdict(self.shape), "label": self.shape.label, "step_ms": self.step_ms,
                "tokens_per_s": self.tokens_per_s, "error": self.error, "profile": profile}


# The table: decode at 1k context for three batch sizes and at 8k, one 2k prefill;
# and 2k prefills back to back, as the engine core runs them.
# The engine settings this bench takes as the engine's own flags (`continuum serve --help`).
ENGINE_SETTINGS = ("dtype", "device", "attention_backend", "layer_kernels", "kv_cache_dtype",
                   "quantization", "enforce_eager", "async_scheduling",
                   "max_num_batched_tokens", "block_size")
DEFAULT_DECODE_SHAPES = [Shape("decode", 1, 1024), Shape("decode", 32, 1024),
                         Shape("decode", 128, 1024), Shape("decode", 32, 8192)]
DEFAULT_PREFILL_SHAPES = [Shape("prefill", 1, 2048), Shape("prefill", 1, 2048, num_steps=8)]
_GREEDY = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
_RANDOM = {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "max_tokens": None,
           "ignore_eos": True}
SAMPLINGS: dict[SamplingName, SamplingParams] = {
    "greedy": _GREEDY,
    "random": SamplingParams(**_RANDOM),
    # Top-p alone, as OpenAI clients send it: no top-k bounds the candidates, so a GPU sorts
    # the vocabulary (with random weights the nucleus is most of it on a CPU too).
    "nucleus": SamplingParams(**{**_RANDOM, "top_k": 0}),
    "seeded": SamplingParams(**_RANDOM, seed=1234),
    "penalties": SamplingParams(**_RANDOM, presence_penalty=0.5, frequency_penalty=0.5,
                                repetition_penalty=1.1),
    "grammar": _GREEDY,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default="tiny", help="'tiny' or a local HF directory")
    source.add_argument("--config", default=None, metavar="FILE",
                        help="a Hugging Face config.json: that model's shapes, random weights")
    add_flags(parser, [setting for setting in EngineArgs.settings()
                       if setting.name in ENGINE_SETTINGS])
    parser.add_argument("--decode", nargs="*", type=functools.partial(Shape.parse, "decode"),
                        default=DEFAULT_DECODE_SHAPES, metavar="BATCHxCONTEXT",
                        help="decode shapes (none: skip decode)")
    parser.add_argument("--prefill", nargs="*", type=functools.partial(Shape.parse, "prefill"),
                        default=DEFAULT_PREFILL_SHAPES, metavar="BATCHxTOKENS",
                        help="prefill shapes (none: skip prefill)")
    parser.add_argument("--extend", nargs="*", type=functools.partial(Shape.parse, "extend"),
                        default=[], metavar="BATCHxTOKENS@CONTEXT[+DECODESxDCONTEXT]",
                        help="chunks of TOKENS over CONTEXT cached tokens, an agent's next "
                             "turn, in a step with a token of each of DECODES requests "
                             "decoding after DCONTEXT tokens if given (default: none)")
    parser.add_argument("--sampling", nargs="+", choices=get_args(SamplingName),
                        default=["greedy"],
                        help="what the requests ask of the sampler: each shape runs under "
                             "each (random: temperature 0.8, top-p 0.95, top-k 50; seeded: "
                             "that with a seed; penalties: that with presence, frequency and "
                             "repetition penalties; grammar: greedy within a random bitmask "
                             "over the vocabulary, drawn once a request and sent with every "
                             "step it samples in, as structured outputs)")
    parser.add_argument("--decode-steps", type=int, default=16, help="steps of one timed run")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs per shape after one warm-up run; the median is kept")
    parser.add_argument("--profile", action="store_true",
                        help="profile one more run of each shape: kernel launches, "
                             "device and host time a step, and the costliest kernels")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and prompts")
    parser.add_argument("--json", dest="json_path", default=None, help="write results here")
    parser.add_argument("--markdown", dest="markdown_path", default=None,
                        help="write the table here too")


def main(args: argparse.Namespace) -> int:
    shapes = [replace(shape, sampling=sampling)
              for shape in [*args.decode, *args.prefill, *args.extend]
              for sampling in dict.fromkeys(args.sampling)]
    if not shapes:
        raise ValueError("no shape to measure: give --decode, --prefill or --extend shapes")
    report = run(args, shapes)
    table = markdown_table(report)
    print(table)
    if args.markdown_path:
        write_report(args.markdown_path, table)
    if args.json_path:
        write_json_report(args.json_path, report)
    return 0


def run(args: argparse.Namespace, shapes: list[Shape]) -> dict[str, Any]:
    """Builds one runner sized for every shape the model's positions hold, measures each, and
    returns the JSON report (a shape beyond the positions is reported as not run).
    ValueError if no shape fits."""
    with tempfile.TemporaryDirectory() as scratch:
        model = _model_dir(args, Path(scratch))
        max_positions = load_arch(model).max_position_embeddings
        fitting = [shape for shape in shapes if _positions(shape, args) <= max_positions]
        if not fitting:
            raise ValueError(f"every shape needs more positions than the model's "
                             f"{max_positions}")
        runner = ModelRunner(_engine_config(args, model, fitting))
    rng = np.random.default_rng(args.seed)
    results = [_measure(runner, shape, args, rng) if shape in fitting else ShapeResult(
        shape, error=f"not run: needs {_positions(shape, args)} positions, the model has "
                     f"{max_positions}") for shape in shapes]
    return {
        "model": _model_name(args),
        **environment(runner.device),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(runner.kv_dtype).removeprefix("torch."),
        "quantization": args.quantization,
        "attention_backend": runner.attention.name,
        "layer_kernels": "triton" if runner.model.use_triton_kernels else "torch",
        # The runner's rule: decode replays graphs on CUDA where the backend has static decode.
        "cuda_graphs": (runner.device.type == "cuda" and not args.enforce_eager
                        and runner.attention.supports_static_decode),
        "async_scheduling": _pipelined(args, runner),
        "block_size": args.block_size,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "decode_steps": args.decode_steps,
        "repeats": args.repeats,
        "results": [result.to_json() for result in results],
    }


def environment(device: torch.device) -> dict[str, str]:
    """The device's name and the torch and triton versions, for reports."""
    try:
        triton_version = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton_version = "not installed"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "torch": torch.__version__, "triton": triton_version}


def markdown_table(report: dict[str, Any]) -> str:
    """The report's shapes as a markdown table under a line naming what ran them."""
    graphs = "CUDA graphs for decode" if report["cuda_graphs"] else "eager"
    weights = ", fp8 projections" if report.get("quantization", "none") != "none" else ""
    lines = [
        f"{report['model']} ({report['dtype']}{weights}) on {report['device']}: torch "
        f"{report['torch']}, triton {report['triton']}, attention {report['attention_backend']},"
        f" layer kernels {report['layer_kernels']}, KV cache {report['kv_cache_dtype']},"
        f" {graphs}",
        "",
        "| shape | ms a step | tokens/s |",
        "|---|---:|---:|",
    ]
    for result in report["results"]:
        if result["error"] is not None:
            lines.append(f"| {result['label']} | {result['error']} | |")
        else:
            lines.append(f"| {result['label']} | {result['step_ms']:.2f} | "
                         f"{result['tokens_per_s']:,.0f} |")
    return "\n".join(lines) + "\n"


def _model_name(args: argparse.Namespace) -> str:
    """`--model`, or the `--config` file's name (its directory's for a `config.json`)."""
    if args.config is None:
        return args.model
    path = Path(args.config)
    return path.parent.name if path.name == "config.json" else path.stem


def _model_dir(args: argparse.Namespace, scratch: Path) -> str:
    """`--model`, or a directory in `scratch` holding the `--config` file as its config.json
    (the runner reads nothing else: weights are drawn, prompts are token ids)."""
    if args.config is None:
        return args.model
    (scratch / "config.json").write_text(Path(args.config).read_text())
    return str(scratch)


def _engine_config(args: argparse.Namespace, model: str, shapes: list[Shape]) -> EngineConfig:
    """A runner config whose KV pool, sequence length and batch hold the largest shape."""
    num_blocks = max(_num_blocks(shape, args) for shape in shapes)
    max_prefill_tokens = max((shape.batch_size * shape.seq_len + shape.decodes_beside
                              for shape in shapes if shape.kind != "decode"), default=0)
    max_model_len = max(_positions(shape, args) for shape in shapes)
    return EngineConfig(
        model=ModelConfig(model=model, dtype=args.dtype, load_format="dummy",
                          max_model_len=max_model_len, seed=args.seed, device=args.device,
                          attention_backend=args.attention_backend,
                          layer_kernels=args.layer_kernels,
                          enforce_eager=args.enforce_eager,
                          quantization=args.quantization),
        cache=CacheConfig(block_size=args.block_size, num_kv_blocks=num_blocks,
                          kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(
            max_model_len=max_model_len,
            max_num_batched_tokens=max(args.max_num_batched_tokens, max_prefill_tokens),
            max_num_seqs=max(_max_num_seqs(shape) for shape in shapes)),
    )


def _max_num_seqs(shape: Shape) -> int:
    """Requests of `shape` in the runner at once: two steps' with prefills back to back (one
    step in flight while the next is launched); an extend's decodes beside its chunks."""
    return shape.batch_size * (2 if shape.num_steps > 1 else 1) + shape.decodes_beside


def _max_seq_len(shape: Shape, args: argparse.Namespace) -> int:
    """Tokens a sequence of `shape` reaches: its prompt (an extend's context and chunk) and
    the token sampled after it; for decode the prompt, the warm-up, timed, profiled and
    (at most) sampled runs' steps and the token sampled by the last one."""
    if shape.kind != "decode":
        return shape.context_len + shape.seq_len + 1
    num_runs = 1 + args.repeats + (1 + _MAX_SAMPLED_DECODE_RUNS) * int(args.profile)
    return shape.seq_len + num_runs * args.decode_steps + 1


def _beside_seq_len(shape: Shape, args: argparse.Namespace) -> int:
    """Tokens a decode beside an extend's chunks reaches: its prompt, a token a measured step
    (warm-up, timed, profiled and sampled) and the token sampled by the last; 0 without."""
    if not shape.decodes_beside:
        return 0
    num_runs = 1 + args.repeats + (1 + _SAMPLED_STEPS) * int(args.profile)
    return shape.decode_context_len + num_runs + 1


def _positions(shape: Shape, args: argparse.Namespace) -> int:
    """Positions the longest sequence of `shape` reaches."""
    return max(_max_seq_len(shape, args), _beside_seq_len(shape, args))


def _blocks_for(num_tokens: int, args: argparse.Namespace) -> int:
    """KV blocks that hold `num_tokens` tokens."""
    return -(-num_tokens // args.block_size)


def _blocks_per_seq(shape: Shape, args: argparse.Namespace) -> int:
    return _blocks_for(_max_seq_len(shape, args), args)


def _num_blocks(shape: Shape, args: argparse.Namespace) -> int:
    """KV blocks the requests of `shape` own: the shape's sequences', then the decodes'
    beside an extend's chunks (`_Sequences`' `first_block`)."""
    return (shape.batch_size * _blocks_per_seq(shape, args)
            + shape.decodes_beside * _blocks_for(_beside_seq_len(shape, args), args))


def _measure(runner: ModelRunner, shape: Shape, args: argparse.Namespace,
             rng: np.random.Generator) -> ShapeResult:
    """One shape's median timed run; the runner holds no request before or after."""
    print(f"measuring {shape.label}", flush=True)
    measure = {"decode": _decode_run_s, "prefill": _prefill_run_s,
               "extend": _extend_run_s}[shape.kind]
    try:
        run_s, step_profile = measure(runner, shape, args, rng)
    except torch.cuda.OutOfMemoryError as error:
        torch.cuda.empty_cache()
        return ShapeResult(shape, error=f"CUDA out of memory: {str(error).splitlines()[0]}")
    if step_profile is not None:
        print(f"profile of {shape.label}: {step_profile.launches_per_step:.1f} launches "
              f"({step_profile.graph_launches_per_step:.1f} graphs), device "
              f"{step_profile.device_ms_per_step:.2f} ms, host "
              f"{step_profile.host_ms_per_step:.2f} ms a step; device idle "
              f"{step_profile.idle.before_first_ms:.2f} ms before its first kernel, "
              f"{step_profile.idle.between_ms:.2f} between, "
              f"{step_profile.idle.after_last_ms:.2f} after its last, a step\n"
              f"{step_profile.top_kernels}\nthe host's time by operator:\n"
              f"{step_profile.top_host_ops}\nthe host's Python, sampled:\n"
              f"{step_profile.host_stacks}",
              flush=True)
    if shape.kind == "decode":
        num_steps, num_tokens = args.decode_steps, shape.batch_size * args.decode_steps
    else:
        num_steps = shape.num_steps
        num_tokens = (shape.batch_size * shape.seq_len + shape.decodes_beside) * num_steps
    return ShapeResult(shape, step_ms=run_s / num_steps * 1e3, tokens_per_s=num_tokens / run_s,
                       profile=step_profile)


def _pipelined(args: argparse.Namespace, runner: ModelRunner) -> bool:
    """Whether decode steps are launched ahead: `--async-scheduling`, else what the engine
    core does by default (`ModelRunner.prefers_async_scheduling`)."""
    if args.async_scheduling is not None:
        return bool(args.async_scheduling)
    return runner.prefers_async_scheduling


def _decode_run_s(runner: ModelRunner, shape: Shape, args: argparse.Namespace,
                  rng: np.random.Generator) -> tuple[float, StepProfile | None]:
    """Seconds of the median timed run of `decode_steps` steps, after prefill and warm-up,
    and with `--profile` the profile of one more run."""
    sequences = _Sequences(runner, "decode", shape, _blocks_per_seq(shape, args), rng)
    try:
        decode = functools.partial(sequences.decode, args.decode_steps,
                                   pipelined=_pipelined(args, runner))
        sequences.prefill(args.max_num_batched_tokens)
        decode()
        run_s = statistics.median(decode() for _ in range(args.repeats))
        step_profile = None
        if args.profile:
            step_profile = profile_steps(decode, args.decode_steps, runner.device)
            with HostStacks() as stacks:  # nothing to prepare between decode runs
                num_runs = _sample_runs(stacks, lambda _: decode(), min_runs=1,
                                        max_runs=_MAX_SAMPLED_DECODE_RUNS)
            step_profile = replace(step_profile, host_stacks=stacks.table(
                num_steps=num_runs * args.decode_steps))
        return run_s, step_profile
    finally:
        sequences.finish()


def _extend_run_s(runner: ModelRunner, shape: Shape, args: argparse.Namespace,
                  rng: np.random.Generator) -> tuple[float, StepProfile | None]:
    """Seconds of the median timed step of `shape.seq_len`-token chunks over the contexts
    (prefilled once, untimed), after one warm-up step, and with `--profile` the profile of
    one more. Each run's requests arrive with the contexts as a prefix-cache hit and leave
    the runner after it. The decodes beside them (`shape.decodes_beside`, under the shape's
    sampling) are prefilled once, untimed, and stay in the runner for the whole shape, a
    token longer after each step."""
    beside = _Sequences(runner, "beside", Shape("decode", shape.decodes_beside,
                                                shape.decode_context_len,
                                                sampling=shape.sampling),
                        _blocks_for(_beside_seq_len(shape, args), args), rng)
    try:
        beside.prefill(args.max_num_batched_tokens)
        return _extend_turns_s(runner, shape, args, rng, beside)
    finally:
        beside.finish()


def _extend_turns_s(runner: ModelRunner, shape: Shape, args: argparse.Namespace,
                    rng: np.random.Generator, beside: _Sequences
                    ) -> tuple[float, StepProfile | None]:
    """`_extend_run_s` once the decodes `beside` the chunks (none, or prefilled) are in."""
    full = replace(shape, seq_len=shape.context_len + shape.seq_len)
    first_block = shape.decodes_beside * _blocks_for(_beside_seq_len(shape, args), args)
    filled = _Sequences(runner, "extend", full, _blocks_per_seq(shape, args), rng,
                        first_block=first_block)
    try:
        filled.prefill(args.max_num_batched_tokens, up_to=shape.context_len)
    finally:
        filled.finish()

    def measured(index: int, measure: Callable[[_Sequences], _T]) -> _T:
        turn = filled.arriving_again(f"extend{index}")
        try:
            return measure(turn)
        finally:
            turn.finish()

    def chunks(turn: _Sequences) -> float:
        return _step_together({turn: dict.fromkeys(turn.prompts, shape.seq_len),
                               beside: dict.fromkeys(beside.prompts, 1)})

    run_s = [measured(index, chunks) for index in range(1 + args.repeats)]
    step_profile = None
    if args.profile:
        step_profile = measured(1 + args.repeats, lambda turn: profile_steps(
            functools.partial(chunks, turn), 1, runner.device))
        stacks = HostStacks()
        for index in range(_SAMPLED_STEPS):
            measured(2 + args.repeats + index,
                     lambda turn: _sample(stacks, functools.partial(chunks, turn)))
        step_profile = replace(step_profile, host_stacks=stacks.table(num_steps=_SAMPLED_STEPS))
    return statistics.median(run_s[1:]), step_profile


def _prefill_run_s(runner: ModelRunner, shape: Shape, args: argparse.Namespace,
                   rng: np.random.Generator) -> tuple[float, StepProfile | None]:
    """Seconds of the median timed run of `shape.num_steps` prefill steps of fresh prompts,
    after one warm-up run, and with `--profile` the profile of one more such run. The prompts
    are drawn before a run, and its requests leave the runner after it."""
    pipelined = _pipelined(args, runner)

    def measured(index: int, measure: Callable[[_PrefillRun], _T]) -> _T:
        prefill_run = _PrefillRun(runner, f"prefill{index}", shape, args, rng)
        try:
            return measure(prefill_run)
        finally:
            prefill_run.finish()

    run_s = [measured(index, lambda prefill_run: prefill_run.run(pipelined))
             for index in range(1 + args.repeats)]
    step_profile = None
    if args.profile:
        step_profile = measured(1 + args.repeats, lambda prefill_run: profile_steps(
            functools.partial(prefill_run.run, pipelined), shape.num_steps, runner.device))
        stacks = HostStacks()
        num_runs = _sample_runs(stacks, lambda index: measured(
            2 + args.repeats + index, lambda prefill_run: _sample(
                stacks, functools.partial(prefill_run.run, pipelined))),
            min_runs=-(-_SAMPLED_STEPS // shape.num_steps), max_runs=None)
        step_profile = replace(step_profile, host_stacks=stacks.table(
            num_steps=num_runs * shape.num_steps))
    return statistics.median(run_s[1:]), step_profile


def _sample(stacks: HostStacks, run: Callable[[], object]) -> None:
    """Adds `run`'s host Python to `stacks`: the run alone, not what prepares it."""
    with stacks:
        run()


def _sample_runs(stacks: HostStacks, sampled_run: Callable[[int], object], min_runs: int,
                 max_runs: int | None) -> int:
    """Calls `sampled_run(index)` (which samples into `stacks`) `min_runs` times, then
    again while `stacks` holds fewer than `_MIN_HOST_SAMPLES` samples, for at most
    `max_runs` runs (None: no bound) and `_MAX_SAMPLING_S` seconds; returns the number of
    runs."""
    deadline_s = time.perf_counter() + _MAX_SAMPLING_S
    num_runs = 0
    while num_runs < min_runs or (stacks.num_samples < _MIN_HOST_SAMPLES
                                  and num_runs != max_runs
                                  and time.perf_counter() < deadline_s):
        sampled_run(num_runs)
        num_runs += 1
    return num_runs


class _PrefillRun:
    """`shape.num_steps` steps, each of `shape.batch_size` fresh prompts of `shape.seq_len`
    tokens. Every step's requests own the same blocks: a step's kernels run after the previous
    step's, in the device's one stream."""

    def __init__(self, runner: ModelRunner, name: str, shape: Shape, args: argparse.Namespace,
                 rng: np.random.Generator) -> None:
        self.steps = [_Sequences(runner, f"{name}-{index}", shape, _blocks_per_seq(shape, args),
                                 rng) for index in range(shape.num_steps)]
        self.seq_len = shape.seq_len
        self.unfinished: list[_Sequences] = []  # launched, still in the runner

    def run(self, pipelined: bool) -> float:
        """Runs the steps in order; returns the seconds from the first launch until the last
        step's tokens are read. `pipelined`: each step is launched before the previous one's
        tokens are read. A step's requests leave the runner once its tokens are read, but for
        the last step's (`finish`), so that a run of one step times that step alone."""
        started_s = time.perf_counter()
        launched: PendingStep | None = None
        for sequences in self.steps:
            if launched is not None and not pipelined:
                self._take(launched)
            previous = launched
            launched = sequences.launch(dict.fromkeys(sequences.prompts, self.seq_len))
            self.unfinished.append(sequences)
            if previous is not None and pipelined:
                self._take(previous)
        assert launched is not None
        launched.result()
        return time.perf_counter() - started_s

    def _take(self, step: PendingStep) -> None:
        """Reads the oldest launched step's tokens and drops its requests from the runner."""
        step.result()
        self.unfinished.pop(0).finish()

    def finish(self) -> None:
        """Drops the requests still in the runner."""
        while self.unfinished:
            self.unfinished.pop(0).finish()


class _Sequences:
    """`shape.batch_size` requests with random prompts of `shape.seq_len` tokens, stepped
    through `runner` by hand-built `SchedulerOutput`s as the scheduler would send them: in full
    the first step a request is scheduled, as deltas after. Request `i` owns the consecutive
    blocks from `first_block + i * blocks_per_seq`; they are all given up front, so no step
    adds blocks.
    Their sampling is `shape.sampling`'s; under `grammar`, request `i` may sample the tokens
    of a random bitmask drawn once (`grammar_words[i]`), sent with every step it samples in."""

    def __init__(self, runner: ModelRunner, name: str, shape: Shape, blocks_per_seq: int,
                 rng: np.random.Generator, first_block: int = 0):
        vocab_size = runner.arch.vocab_size
        prompts = [rng.integers(0, vocab_size, shape.seq_len).tolist()
                   for _ in range(shape.batch_size)]
        grammar_words = None
        if shape.sampling == "grammar":
            grammar_words = rng.integers(-2**31, 2**31, (shape.batch_size, -(-vocab_size // 32)),
                                         dtype=np.int64).astype(np.int32)
        self._start(runner, name, prompts, blocks_per_seq, first_block, [0] * len(prompts),
                    shape.sampling, grammar_words)

    def _start(self, runner: ModelRunner, name: str, prompts: list[list[int]],
               blocks_per_seq: int, first_block: int, num_computed: list[int],
               sampling: SamplingName, grammar_words: np.ndarray | None) -> None:
        """Requests `name-0` onwards, none sent yet: request `i` has prompt `prompts[i]`,
        blocks from `first_block + i * blocks_per_seq` and `num_computed[i]` tokens already
        cached."""
        self.runner = runner
        self.blocks_per_seq = blocks_per_seq
        self.first_block = first_block
        self.sampling = sampling
        self.grammar_words = grammar_words
        self.prompts = {f"{name}-{index}": prompt for index, prompt in enumerate(prompts)}
        self.block_ids = {req_id: list(range(first_block + index * blocks_per_seq,
                                             first_block + (index + 1) * blocks_per_seq))
                          for index, req_id in enumerate(self.prompts)}
        self.num_computed = dict(zip(self.prompts, num_computed, strict=True))
        self.sent: set[str] = set()
        self.step_id = 0

    def prefill(self, token_budget: int, up_to: int | None = None) -> float:
        """Every prompt (its first `up_to` tokens, if given), in steps of at most
        `token_budget` tokens, in request order; returns the seconds the runner took."""
        if up_to is not None and not all(0 < up_to < len(p) for p in self.prompts.values()):
            raise ValueError(f"up_to must leave every prompt a token to compute, got {up_to}")
        pending = {req_id: len(prompt) if up_to is None else up_to
                   for req_id, prompt in self.prompts.items()}
        runner_s = 0.0
        while pending:
            scheduled: dict[str, int] = {}
            budget = token_budget
            for req_id, remaining in pending.items():
                if budget == 0:
                    break
                scheduled[req_id] = min(remaining, budget)
                budget -= scheduled[req_id]
            runner_s += self.step(scheduled)
            pending = {req_id: remaining - scheduled.get(req_id, 0)
                       for req_id, remaining in pending.items()
                       if remaining > scheduled.get(req_id, 0)}
        return runner_s

    def decode(self, num_steps: int, *, pipelined: bool = False) -> float:
        """`num_steps` steps of one token for every request; returns the runner's seconds.
        `pipelined`: each step is launched before the previous one's tokens are read."""
        one_token = dict.fromkeys(self.prompts, 1)
        if not pipelined:
            return sum(self.step(one_token) for _ in range(num_steps))
        started_s = time.perf_counter()
        previous = None
        for _ in range(num_steps):
            launched = self.launch(one_token)
            if previous is not None:
                previous.result()
            previous = launched
        if previous is not None:
            previous.result()
        return time.perf_counter() - started_s

    def step(self, num_tokens: dict[str, int]) -> float:
        """One runner step scheduling `num_tokens[req_id]` tokens of each named request;
        returns the seconds it took to launch and read back (the sampled ids on the host)."""
        started_s = time.perf_counter()
        self.launch(num_tokens).result()
        return time.perf_counter() - started_s

    def launch(self, num_tokens: dict[str, int]) -> PendingStep:
        """Launches one runner step scheduling `num_tokens[req_id]` tokens of each named
        request; its tokens are read by the returned step's `result`."""
        return self.runner.submit(self.scheduled(num_tokens))

    def scheduled(self, num_tokens: dict[str, int]) -> SchedulerOutput:
        """The step scheduling `num_tokens[req_id]` tokens of each named request, counted as
        sent and computed: the caller submits it (alone, or merged: `_step_together`).
        ValueError if a request would pass the end of its blocks."""
        capacity = self.blocks_per_seq * self.runner.block_size
        for req_id, count in num_tokens.items():
            if self.num_computed[req_id] + count > capacity:
                raise ValueError(f"{req_id} would hold {self.num_computed[req_id] + count} "
                                 f"tokens in blocks of {capacity}")
        new = [NewRequestData(req_id=req_id, prompt_token_ids=self.prompts[req_id],
                              output_token_ids=[], sampling_params=SAMPLINGS[self.sampling],
                              block_ids=self.block_ids[req_id],
                              num_computed_tokens=self.num_computed[req_id])
               for req_id in num_tokens if req_id not in self.sent]
        cached_ids = [req_id for req_id in num_tokens if req_id in self.sent]
        output = SchedulerOutput(
            step_id=self.step_id, scheduled_new_reqs=new,
            scheduled_cached_reqs=CachedRequestData(
                req_ids=cached_ids, new_block_ids=[[] for _ in cached_ids],
                num_computed_tokens=[self.num_computed[req_id] for req_id in cached_ids]),
            num_scheduled_tokens=num_tokens, total_num_scheduled_tokens=sum(num_tokens.values()),
            finished_req_ids=set(), preempted_req_ids=set(),
            grammar_bitmask=self._grammar_bitmask(num_tokens))
        # Marked before the step: if it fails (out of memory), the runner holds them already.
        self.sent.update(num_tokens)
        for req_id, count in num_tokens.items():
            self.num_computed[req_id] += count
        self.step_id += 1
        return output

    def _grammar_bitmask(self, num_tokens: dict[str, int]) -> GrammarBitmask | None:
        """The bitmask rows of the step's requests that sample (reach the end of their
        prompt or decode), as the engine core sends them; None without a grammar."""
        if self.grammar_words is None:
            return None
        indices = [index for index, (req_id, prompt) in enumerate(self.prompts.items())
                   if req_id in num_tokens
                   and self.num_computed[req_id] + num_tokens[req_id] >= len(prompt)]
        if not indices:
            return None
        names = list(self.prompts)
        return GrammarBitmask([names[index] for index in indices], self.grammar_words[indices])

    def arriving_again(self, name: str) -> _Sequences:
        """New requests, `name-0` onwards, over these prompts and blocks, arriving with the
        tokens these have computed already in the cache, as a prefix-cache hit does. These
        must have left the runner (`finish`)."""
        if any(req_id in self.runner.batch.row_of for req_id in self.sent):
            raise ValueError("these requests are still in the runner: finish them first")
        again = _Sequences.__new__(_Sequences)
        again._start(self.runner, name, list(self.prompts.values()), self.blocks_per_seq,
                     self.first_block, list(self.num_computed.values()), self.sampling,
                     self.grammar_words)
        return again

    def finish(self) -> None:
        """Drops every request from the runner (a step that schedules no token), if any was
        sent."""
        if not self.sent:
            return
        self.runner.execute_model(SchedulerOutput(
            step_id=self.step_id, scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(),
            num_scheduled_tokens={}, total_num_scheduled_tokens=0,
            finished_req_ids=set(self.sent), preempted_req_ids=set()))


def _step_together(groups: dict[_Sequences, dict[str, int]]) -> float:
    """One runner step scheduling tokens of several groups' requests (`_Sequences.scheduled`
    of each, merged); returns the seconds it took to launch and read back."""
    started_s = time.perf_counter()  # building the step counts, as in `_Sequences.step`
    outputs = [sequences.scheduled(num_tokens) for sequences, num_tokens in groups.items()
               if num_tokens]
    step = outputs[0] if len(outputs) == 1 else _merged(outputs)
    next(iter(groups)).runner.submit(step).result()
    return time.perf_counter() - started_s


def _merged(outputs: list[SchedulerOutput]) -> SchedulerOutput:
    """One step of several groups' steps (the first's id), their grammars' rows joined."""
    masks = [output.grammar_bitmask for output in outputs if output.grammar_bitmask is not None]
    cached = [output.scheduled_cached_reqs for output in outputs]
    num_scheduled = {req_id: count for output in outputs
                     for req_id, count in output.num_scheduled_tokens.items()}
    return SchedulerOutput(
        step_id=outputs[0].step_id,
        scheduled_new_reqs=[new for output in outputs for new in output.scheduled_new_reqs],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=[req_id for part in cached for req_id in part.req_ids],
            new_block_ids=[blocks for part in cached for blocks in part.new_block_ids],
            num_computed_tokens=[count for part in cached for count in part.num_computed_tokens]),
        num_scheduled_tokens=num_scheduled, total_num_scheduled_tokens=sum(num_scheduled.values()),
        finished_req_ids=set(), preempted_req_ids=set(),
        grammar_bitmask=GrammarBitmask([req_id for mask in masks for req_id in mask.req_ids],
                                       np.concatenate([mask.words for mask in masks]))
        if masks else None)
