"""`continuum bench sim`: policies compared on an agent trace, in simulated time.

Every (policy, load) pair is one discrete-event simulation (`eval.simulator`) of the same
jobs arriving by the same Poisson draw, on the real scheduler with the `simulated` executor.
Prints a markdown table; `--json` writes every run's figures, `--plot` the JCT-against-load
PNG. Deterministic for a seed, whatever `--workers`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

from engine.executor.roofline import DEFAULT_SIM_PROFILE, SIM_PROFILES
from eval.arrivals import arrivals_s
from eval.report import markdown_table, plot_jct_vs_load
from eval.simulator import SimSettings, simulate
from eval.workload import AgentJobSpec, LoadOptions, ToolDurationSampler, load_jobs

DEFAULT_POLICIES = "fcfs,continuum-fixed,infercept,autellix,continuum"
QUANTILES_FILE = "tool_duration_quantiles.json"


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared with `bench agent`: which jobs of which trace, and how they arrive."""
    group = parser.add_argument_group("workload")
    group.add_argument("--trace", required=True, help="agent-job JSONL trace")
    group.add_argument("--num-jobs", type=int, default=None, help="first N jobs (default: all)")
    group.add_argument("--max-turns", type=int, default=None,
                       help="truncate jobs to N turns (default: keep all)")
    group.add_argument("--token-scale", type=float, default=1.0,
                       help="multiply every token count, to fit a small model (default: 1)")
    group.add_argument("--output-tokens-per-turn", type=int, default=80,
                       help="splits context_tokens_after traces (default: 80)")
    group.add_argument("--tool-quantiles", default=None,
                       help=f"synthesizes missing tool durations (default: {QUANTILES_FILE} "
                            "beside the trace, if there)")
    group.add_argument("--seed", type=int, default=0,
                       help="seed of arrivals, synthesized durations and prompts (default: 0)")


def load_workload(args: argparse.Namespace) -> list[AgentJobSpec]:
    """The jobs the workload flags select; ValueError with the reason if they cannot be
    read."""
    quantiles = args.tool_quantiles
    if quantiles is None and (Path(args.trace).parent / QUANTILES_FILE).exists():
        quantiles = Path(args.trace).parent / QUANTILES_FILE
    sampler = None if quantiles is None else ToolDurationSampler.from_file(quantiles)
    options = LoadOptions(max_jobs=args.num_jobs, max_turns=args.max_turns,
                          output_tokens_per_turn=args.output_tokens_per_turn,
                          token_scale=args.token_scale, seed=args.seed)
    return load_jobs(args.trace, options, tool_durations=sampler)


def parse_loads(text: str) -> list[float | None]:
    """`0.5,1,2` -> jobs per second; `all` means every job at once."""
    loads: list[float | None] = []
    for item in text.split(","):
        item = item.strip()
        if item == "all":
            loads.append(None)
            continue
        try:
            value = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a load: {item!r}") from None
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"a load must be a positive rate, got {item!r}")
        loads.append(value)
    return loads


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    parser.add_argument("--profile", default=DEFAULT_SIM_PROFILE, choices=sorted(SIM_PROFILES),
                        help=f"cost profile (default: {DEFAULT_SIM_PROFILE})")
    parser.add_argument("--policies", default=DEFAULT_POLICIES,
                        help=f"comma-separated policies (default: {DEFAULT_POLICIES})")
    parser.add_argument("--jobs-per-s", type=parse_loads, required=True,
                        help="comma-separated Poisson loads in jobs/s; 'all' = all at once")
    parser.add_argument("--estimator", default="eq2-empirical",
                        help="TTL estimator of the continuum policy (default: eq2-empirical)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="KV pool size (default: what the profile's memory holds)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--workers", type=int, default=1,
                        help="simulations run in parallel processes (default: 1)")
    parser.add_argument("--json", default=None, help="write every run's figures here")
    parser.add_argument("--plot", default=None, help="write the JCT-against-load PNG here")


def run_comparison(
    jobs: list[AgentJobSpec], settings: SimSettings, policies: list[str],
    loads: list[float | None], *, workers: int = 1,
) -> list[dict]:
    """One simulation per (policy, load); the runs' figures in (load, policy) order."""
    tasks = [(jobs, replace(settings, policy=policy), load)
             for load in loads for policy in policies]
    if workers <= 1:
        return [_run_one(task) for task in tasks]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(_run_one, tasks))


def _run_one(task: tuple[list[AgentJobSpec], SimSettings, float | None]) -> dict:
    jobs, settings, load = task
    started_s = time.perf_counter()
    metrics = simulate(jobs, arrivals_s(len(jobs), load, seed=settings.seed), settings)
    return {"policy": settings.policy, "jobs_per_s": load, **metrics.to_dict(),
            "wall_s": time.perf_counter() - started_s}


def workload_summary(jobs: list[AgentJobSpec]) -> dict:
    num_turns = [len(job.turns) for job in jobs]
    tools = [t.tool_duration_s for job in jobs for t in job.turns if t.tool_duration_s is not None]
    return {
        "num_jobs": len(jobs),
        "mean_turns": sum(num_turns) / len(jobs),
        "mean_max_seq_len": sum(job.max_seq_len for job in jobs) / len(jobs),
        "max_seq_len": max(job.max_seq_len for job in jobs),
        "mean_output_tokens_per_turn": sum(job.num_output_tokens for job in jobs)
        / sum(num_turns),
        "mean_tool_s": sum(tools) / len(tools) if tools else 0.0,
        "tokens_estimated": any(job.tokens_estimated for job in jobs),
    }


def main(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    try:
        if not policies:
            raise ValueError("--policies names no policy")
        jobs = load_workload(args)
        settings = SimSettings(
            policy=policies[0], profile=args.profile,
            estimator=args.estimator, block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed,
        )
        runs = run_comparison(jobs, settings, policies, args.jobs_per_s, workers=args.workers)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    title = f"{Path(args.trace).name} on {args.profile} ({len(jobs)} jobs)"
    print(f"{title}\n\n{markdown_table(runs)}")
    if args.json:
        report = {"trace": args.trace, "profile": args.profile,
                  "settings": {k: v for k, v in asdict(settings).items() if k != "policy"},
                  "workload": workload_summary(jobs), "runs": runs}
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        plot_jct_vs_load(runs, args.plot, title=title)
    return 0
