"""`continuum bench scheduler`: CPU cost of one scheduler step at a steady decode batch.

Fills the engine with `--num-requests` requests (distinct prompts, prefix caching on), runs
their prefills, then times `schedule()` + `update_from_output()` over `--steps` decode steps.
The model is replaced by a synthetic runner output built outside the timed region. With
`--trace-path`, every step is traced (records built, encoded and written once per step).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time
from typing import Any

from engine.config import CacheConfig, SchedulerConfig
from engine.outputs import ModelRunnerOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler.output import SchedulerOutput
from engine.scheduler.policy_registry import make_policy
from engine.scheduler.scheduler import Scheduler
from engine.scheduler.tracer import SchedulerTracer
from eval.report import emit


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--num-blocks", type=int, default=16384)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=512, help="timed decode steps")
    parser.add_argument("--warmup-steps", type=int, default=16)
    parser.add_argument("--policy", default="fcfs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace-path", default=None,
                        help="trace every step to this file (measures the tracing cost)")
    parser.add_argument("--json", dest="json_path", default=None, help="write results here")


def main(args: argparse.Namespace) -> int:
    results = run(args)
    emit("scheduler step cost (schedule + update_from_output)", results, args.json_path)
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    budget = max(8192, args.prompt_len)
    num_prefill_steps = -(-args.num_requests * args.prompt_len // budget) + 1
    max_model_len = args.prompt_len + num_prefill_steps + args.warmup_steps + args.steps + 8
    scheduler = Scheduler(
        SchedulerConfig(
            max_model_len=max_model_len,
            max_num_batched_tokens=budget,
            max_num_seqs=args.num_requests,
            policy=args.policy,
        ),
        CacheConfig(block_size=args.block_size, enable_prefix_caching=True),
        make_policy(args.policy),
        num_kv_blocks=args.num_blocks,
        tracer=None if args.trace_path is None else SchedulerTracer(args.trace_path),
    )
    _add_requests(scheduler, args)
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in scheduler.requests.values()):
        _step(scheduler)
    for _ in range(args.warmup_steps):
        _step(scheduler)
    gc.collect()
    schedule_us, update_us = [], []
    for _ in range(args.steps):
        schedule_s, update_s = _step(scheduler)
        schedule_us.append(schedule_s * 1e6)
        update_us.append(update_s * 1e6)
        if len(scheduler.running) != args.num_requests:
            raise ValueError(
                f"the decode batch fell to {len(scheduler.running)} of {args.num_requests} "
                "requests (pool too small: raise --num-blocks)"
            )
    total_us = [a + b for a, b in zip(schedule_us, update_us, strict=True)]
    return {
        "num_running": len(scheduler.running),
        "num_blocks": args.num_blocks,
        "block_size": args.block_size,
        "steps": args.steps,
        "policy": args.policy,
        "median_us": statistics.median(total_us),
        "p99_us": _percentile(total_us, 0.99),
        "mean_us": statistics.fmean(total_us),
        "schedule_median_us": statistics.median(schedule_us),
        "update_median_us": statistics.median(update_us),
        "preemptions": scheduler.num_preemptions,
        "recomputed_tokens": scheduler.recomputed_tokens,
        "traced": args.trace_path is not None,
        "trace_bytes_per_step": _trace_bytes_per_step(scheduler, args.trace_path),
    }


def _trace_bytes_per_step(scheduler: Scheduler, trace_path: str | None) -> float | None:
    if trace_path is None:
        return None
    scheduler.close_subscribers()
    return os.path.getsize(trace_path) / max(1, scheduler.step_id)


def _add_requests(scheduler: Scheduler, args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=None, ignore_eos=True)
    for index in range(args.num_requests):
        prompt = [rng.randrange(1, 32000) for _ in range(args.prompt_len)]
        scheduler.add_request(
            Request(f"req-{index}", prompt, params, arrival_time_s=scheduler.clock())
        )


def _step(scheduler: Scheduler) -> tuple[float, float]:
    """One step; returns the seconds spent in `schedule()` and in `update_from_output()`."""
    start = time.perf_counter()
    output = scheduler.schedule()
    scheduled = time.perf_counter()
    runner_output = _synthetic_runner_output(scheduler, output)
    before_update = time.perf_counter()
    scheduler.update_from_output(output, runner_output)
    return scheduled - start, time.perf_counter() - before_update


def _synthetic_runner_output(scheduler: Scheduler, output: SchedulerOutput
                             ) -> ModelRunnerOutput:
    """A token for each request the step was scheduled to sample (not for a prompt's chunk
    that leaves some of it uncomputed)."""
    req_ids = list(output.num_scheduled_tokens)
    token_id = 1 + output.step_id % 1000
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[
        [token_id] if scheduler.requests[req_id].num_output_placeholders else []
        for req_id in req_ids])


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]
