"""`continuum bench throughput`: offline generation on the engine against transformers.

The workload: `--num-requests` requests with prompts of random token ids (lengths uniform in
`--prompt-len MIN MAX`) and forced output lengths (uniform in `--output-len MIN MAX`: greedy,
EOS ignored), drawn from `--workload-seed`. The engine runs it through `LLM.generate` (continuous
batching, paged KV cache). Transformers runs `generate` on the same requests in static batches
of `--hf-batch-size`, in request order, left-padded, each batch generating as many tokens as
its longest request needs (only each request's own tokens count as output).

Reported: output tokens/s of both and their ratio; the engine's efficiency (time inside the
executor, which runs the model forward and sampling, over the wall time of `generate`) and
its mean per-step overhead (wall time outside the executor per step); the workload's counts
that bound any run of it (`workload`, `eval.gpu_floors.WorkloadCounts`). With
`--kv-offload-gib` (`--impl engine`), also the share of step time the host-tier copies held
steps up and the tokens stored and loaded. On CUDA, also what the caching allocator did
during the run (`cuda_allocator`: `cudaMalloc`s, `cudaFree`s and allocations retried after
freeing the cache, each of which synchronizes the device). With `--slow-steps N`, the engine
is driven one `LLMEngine.step` at a time instead of through `generate`, and the N slowest
timed steps are reported (`slow_steps`: each step's index, wall milliseconds, requests
running and waiting after it; its milliseconds submitting steps and taking their results
inside the executor (`StepRecord`); Python's collections and Triton's compiles or disk-cache
loads inside it, `eval.step_events`; and on CUDA what the caching allocator did inside
it), with the count and the seconds of every step in which the allocator called `cudaFree`
or retried (`allocator_steps`): what a slow step spent its time on. An untimed warm-up on
prompts of its own comes first, so the timed run finds no prompt cached. With `--profile`
(`--impl engine`), the workload runs once more, from an emptied prefix cache, under the
torch profiler (`profile`: that run's wall seconds, the device's busy seconds and those
seconds by kind of kernel, `eval.step_profile`; the costliest kernels printed): where a
run's device time goes. Each side runs in its own fresh process (a model loaded second in
one process runs measurably slower on small CPUs).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec

from engine.core.gc_heap import startup_heap_frozen
from engine.engine_args import EngineArgs
from eval.gpu_floors import counts_of
from eval.report import emit
from eval.step_events import NUM_GENERATIONS, StepEventRecorder

_IMPLEMENTATIONS = ("engine", "transformers")
_WORKLOAD_FLAGS = ("num_requests", "workload_seed", "hf_batch_size", "slow_steps")
_VOCAB_FOR_PROMPTS = 256  # byte tokens: valid for every model we ship or load


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(64, 512),
                        metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 256),
                        metavar=("MIN", "MAX"))
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=16,
                        help="static batch size of transformers' generate")
    parser.add_argument("--impl", choices=("both", *_IMPLEMENTATIONS), default="both",
                        help="run one side in this process (used by 'both')")
    parser.add_argument("--json", dest="json_path", default=None, help="write results here")
    parser.add_argument("--slow-steps", type=int, default=0, metavar="N",
                        help="report the N slowest engine steps, each with its time in the "
                             "executor's launch and wait, Python's collections, Triton's "
                             "compiles and what the CUDA caching allocator did in it (engine "
                             "side only; default: 0, none)")
    parser.add_argument("--profile", action="store_true",
                        help="run the workload once more under the torch profiler: device "
                             "time by kind of kernel (--impl engine only)")
    EngineArgs.add_cli_args(parser)


def main(args: argparse.Namespace) -> int:
    if args.profile and args.impl != "engine":
        print("error: --profile profiles the engine's run: give --impl engine", file=sys.stderr)
        return 2
    if args.impl == "both":
        results = compare(args)
    elif args.impl == "engine":
        results = run_engine(args)
    else:
        results = run_transformers(args)
    emit(f"offline throughput, {args.model}, {args.num_requests} requests", results,
         args.json_path)
    return 0


def make_workload(args: argparse.Namespace) -> list[BenchRequest]:
    rng = random.Random(args.workload_seed)
    return [
        BenchRequest(
            prompt_token_ids=[rng.randrange(_VOCAB_FOR_PROMPTS)
                              for _ in range(rng.randint(*args.prompt_len))],
            output_len=rng.randint(*args.output_len),
        )
        for _ in range(args.num_requests)
    ]


def compare(args: argparse.Namespace) -> dict[str, Any]:
    sides = {}
    with tempfile.TemporaryDirectory() as scratch:
        for impl in _IMPLEMENTATIONS:
            path = Path(scratch) / f"{impl}.json"
            subprocess.run(
                [sys.executable, "-m", "engine.cli", "bench", "throughput",
                 *_forwarded_flags(args), "--impl", impl, "--json", str(path)],
                check=True, capture_output=True, text=True,
            )
            sides[impl] = json.loads(path.read_text())
    engine, hf = sides["engine"], sides["transformers"]
    return {
        "model": args.model,
        "num_requests": args.num_requests,
        "output_tokens": engine["output_tokens"],
        "tokens_per_s": engine["tokens_per_s"],
        "hf_tokens_per_s": hf["tokens_per_s"],
        "ratio": engine["tokens_per_s"] / hf["tokens_per_s"],
        "engine_efficiency": engine["engine_efficiency"],
        "step_overhead_ms": engine["step_overhead_ms"],
        "num_steps": engine["num_steps"],
        "async_scheduling": engine["async_scheduling"],
        "engine_wall_s": engine["wall_s"],
        "hf_wall_s": hf["wall_s"],
        "hf_batch_size": args.hf_batch_size,
        **{key: engine[key] for key in ("slow_steps", "allocator_steps") if key in engine},
    }


def _forwarded_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--prompt-len", *map(str, args.prompt_len),
             "--output-len", *map(str, args.output_len)]
    for name in _WORKLOAD_FLAGS:
        flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return flags + EngineArgs.cli_flags(args)


def run_engine(args: argparse.Namespace) -> dict[str, Any]:
    """The workload through `LLM.generate`, after an untimed warm-up."""
    from engine.frontend.llm import LLM
    from engine.sampling_params import SamplingParams

    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**vars(engine_args))
    workload = make_workload(args)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.output_len)
              for r in workload]
    prompts = [r.prompt_token_ids for r in workload]
    # Prompts of its own: the timed run would find the warm-up's prefixes cached.
    warm_up = [[(token + 1) % _VOCAB_FOR_PROMPTS for token in prompt] for prompt in prompts[:8]]
    llm.generate(warm_up, params[:8], use_tqdm=False)
    with startup_heap_frozen():  # as serve's core process runs, for the timed part
        before = llm.engine.get_stats()
        allocator_before = _cuda_allocator_counts()
        steps: list[StepRecord] = []
        start = time.perf_counter()
        if args.slow_steps > 0:
            outputs = _generate_step_by_step(llm.engine, prompts, params, steps)
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        wall_s = time.perf_counter() - start
    after = llm.engine.get_stats()
    allocator_after = _cuda_allocator_counts()
    profile = _profile(llm, prompts, params) if args.profile else None
    llm.shutdown()
    num_output_tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    assert num_output_tokens == sum(r.output_len for r in workload), "lengths were not forced"
    execute_s = after.execute_time_s - before.execute_time_s
    num_steps = after.num_steps - before.num_steps
    return {
        "output_tokens": num_output_tokens,
        "wall_s": wall_s,
        "tokens_per_s": num_output_tokens / wall_s,
        "engine_efficiency": execute_s / wall_s,
        "step_overhead_ms": (wall_s - execute_s) / num_steps * 1e3,
        "num_steps": num_steps,
        "async_scheduling": after.async_scheduling,
        "model": Path(args.model).name,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "workload": asdict(counts_of([len(prompt) for prompt in prompts],
                                     [request.output_len for request in workload])),
        **_host_tier_figures(before, after, wall_s),
        **({"cuda_allocator": {name: allocator_after[name] - allocator_before[name]
                               for name in allocator_after}} if allocator_after else {}),
        **(_step_figures(steps, args.slow_steps) if steps else {}),
        **({"profile": profile} if profile is not None else {}),
    }


def _profile(llm: Any, prompts: list[list[int]], params: list[Any]) -> dict[str, Any]:
    """The workload run once more under the torch profiler, from an empty prefix cache: its
    wall seconds, the device's busy seconds and those by kind of kernel; the costliest
    kernels are printed. `{"error": ...}` when the timed run's prompts cannot be forgotten
    (a block still held: a pinned job's)."""
    import torch

    from eval.step_profile import profile_run

    if not llm.engine.reset_prefix_cache():
        error = "the prefix cache could not be reset (a KV block is still held): no profile"
        print(f"warning: {error}", file=sys.stderr, flush=True)
        return {"error": error}

    def run() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    with startup_heap_frozen():
        profiled = profile_run(run, torch.device("cuda" if _cuda_in_use() else "cpu"))
    print(f"profiled run: {profiled.wall_s:.2f} s, device busy {profiled.device_busy_s:.2f} s"
          f"\n{profiled.top_kernels}", flush=True)
    return {"wall_s": profiled.wall_s, "device_busy_s": profiled.device_busy_s,
            "device_s_by_group": profiled.device_s_by_group}


@dataclass(frozen=True)
class StepRecord:
    """One timed engine step: its index in the run, its wall milliseconds, the requests
    running and waiting after it, the caching allocator's counters' growth inside it
    (empty without CUDA), and what else took its time, in milliseconds:
    - `submit_ms`, in `executor.submit`: on CUDA the inputs prepared and the kernels
      enqueued; on CPU, or with a host KV tier, the whole forward (it runs there);
    - `wait_ms`, in taking a step's result: waiting for the device (for the step before,
      under async scheduling) and reading the sampled tokens back;
    - the rest of `wall_ms`: scheduling, applying the outputs, the output processor;
    - Python's collections by generation and their time, and Triton's kernels compiled or
      loaded from its disk cache (`eval.step_events.StepEvents`; None without Triton).
    """

    index: int
    wall_ms: float
    num_running: int
    num_waiting: int
    allocator: dict[str, int]
    submit_ms: float = 0.0
    wait_ms: float = 0.0
    gc_collections: tuple[int, ...] = (0,) * NUM_GENERATIONS
    gc_ms: float = 0.0
    triton_compiles: tuple[str, ...] | None = ()


def _generate_step_by_step(engine: Any, prompts: list[list[int]], params: list[Any],
                           steps: list[StepRecord]) -> list[Any]:
    """What `LLM.generate` does, one `LLMEngine.step` at a time, appending a `StepRecord`
    for each step to `steps`; the finished outputs in request order."""
    from engine.sampling_params import RequestOutputKind

    request_ids = [f"bench-{index}" for index in range(len(prompts))]
    for request_id, prompt, sampling in zip(request_ids, prompts, params, strict=True):
        engine.add_request(request_id, prompt, msgspec.structs.replace(
            sampling, output_kind=RequestOutputKind.FINAL_ONLY))
    finished: dict[str, Any] = {}
    stats = engine.get_stats()
    with StepEventRecorder() as recorder:
        while engine.has_unfinished_requests():
            counts_before, stats_before = _cuda_allocator_counts(), stats
            recorder.take()
            started_s = time.perf_counter()
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
            wall_ms = (time.perf_counter() - started_s) * 1e3
            events = recorder.take()
            counts_after = _cuda_allocator_counts()
            stats = engine.get_stats()
            submit_s = stats.submit_time_s - stats_before.submit_time_s
            steps.append(StepRecord(
                len(steps), wall_ms, stats.num_running, stats.num_waiting,
                {name: counts_after[name] - counts_before[name] for name in counts_after},
                submit_ms=submit_s * 1e3,
                wait_ms=(stats.execute_time_s - stats_before.execute_time_s - submit_s) * 1e3,
                gc_collections=events.gc_collections, gc_ms=events.gc_ms,
                triton_compiles=events.triton_compiles))
    return [finished[request_id] for request_id in request_ids]


def _step_figures(steps: list[StepRecord], num_slow: int) -> dict[str, Any]:
    """The slowest steps, and the steps in which the allocator freed device memory or
    retried an allocation (each such call waits for the device)."""
    slowest = sorted(steps, key=lambda step: step.wall_ms, reverse=True)[:num_slow]
    freeing = [step for step in steps
               if step.allocator.get("device_frees", 0) or step.allocator.get("alloc_retries", 0)]
    return {
        "slow_steps": [asdict(step) for step in slowest],
        "allocator_steps": {"num_steps": len(freeing),
                            "wall_s": sum(step.wall_ms for step in freeing) / 1e3},
    }


def _cuda_in_use() -> bool:
    """Whether this process (the in-process engine) has started using CUDA."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _cuda_allocator_counts() -> dict[str, int]:
    """The caching allocator's cumulative device allocations, frees and retried allocations
    of this process (the in-process engine's); {} without CUDA."""
    import torch

    if not _cuda_in_use():
        return {}
    stats = torch.cuda.memory_stats()
    return {"device_allocs": stats.get("num_device_alloc", 0),
            "device_frees": stats.get("num_device_free", 0),
            "alloc_retries": stats.get("num_alloc_retries", 0)}


def _host_tier_figures(before: Any, after: Any, wall_s: float) -> dict[str, Any]:
    """With `--kv-offload-gib`: the share of the run's step time the host-tier copies held
    steps up, and the tokens stored and loaded."""
    if not after.num_host_kv_blocks:
        return {}
    step_s = after.step_time_s - before.step_time_s
    return {
        "kv_copy_share_of_step_time": (after.kv_copy_time_s - before.kv_copy_time_s) / step_s,
        "host_kv_stored_tokens": after.host_kv_stored_tokens - before.host_kv_stored_tokens,
        "host_kv_loaded_tokens": after.host_kv_loaded_tokens - before.host_kv_loaded_tokens,
    }


def run_transformers(args: argparse.Namespace) -> dict[str, Any]:
    """The workload through transformers' `generate` in static, left-padded batches."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.model.directory import resolve_model_dir
    from engine.model.loader import resolve_device, resolve_dtype

    config = AutoConfig.from_pretrained(resolve_model_dir(args.model))
    torch.manual_seed(args.workload_seed)
    device = resolve_device(args.device)  # the engine's device and dtype rules
    model = AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(args.dtype, device))
    model = model.to(device).eval()
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0
    workload = make_workload(args)
    batches = [workload[i : i + args.hf_batch_size]
               for i in range(0, len(workload), args.hf_batch_size)]
    _generate_batch(model, batches[0][:2], pad_id, device)  # warm-up
    start = time.perf_counter()
    for batch in batches:
        _generate_batch(model, batch, pad_id, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall_s = time.perf_counter() - start
    num_output_tokens = sum(r.output_len for r in workload)
    return {"output_tokens": num_output_tokens, "wall_s": wall_s,
            "tokens_per_s": num_output_tokens / wall_s}


def _generate_batch(model: Any, batch: list[BenchRequest], pad_id: int, device: Any) -> None:
    import torch

    width = max(len(r.prompt_token_ids) for r in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.int64)
    for row, request in enumerate(batch):
        length = len(request.prompt_token_ids)
        input_ids[row, width - length :] = torch.tensor(request.prompt_token_ids)
        attention_mask[row, width - length :] = 1
    num_new_tokens = max(r.output_len for r in batch)
    with torch.inference_mode():
        model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                       do_sample=False,
                       max_new_tokens=num_new_tokens, min_new_tokens=num_new_tokens,
                       pad_token_id=pad_id)
