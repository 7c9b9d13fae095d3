"""The workload flags of the commands that replay agent jobs (`bench sim`, `agent`, `soak`;
`check-calibration` parses its runs' flags with them): which jobs of which workload or trace,
truncated, scaled and drawn, and the argparse types they use.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

from eval.workload import AgentJobSpec, LoadOptions, ToolDurationSampler, draw_jobs, load_jobs
from eval.workloads import QUANTILES_FILE, add_trace_arguments, workload_source

Number = TypeVar("Number", int, float)


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    return positive_number(int, "an integer", text)


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    return positive_number(float, "a number", text)


def positive_number(kind: Callable[[str], Number], what: str, text: str) -> Number:
    """`text` read by `kind` as a finite number > 0; ArgumentTypeError naming `what` was
    expected otherwise."""
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload flags: which jobs of which workload or trace, how they are shaped, and
    the seed of their arrivals."""
    group = parser.add_argument_group("workload", "--workload NAME or --trace FILE, one of them")
    add_trace_arguments(group)
    group.add_argument("--first-jobs", type=positive_int, default=None, metavar="N",
                       help="keep only the first N jobs of the file (default: all)")
    group.add_argument("--num-jobs", type=positive_int, default=None, metavar="N",
                       help="draw N jobs uniformly with replacement (seeded by --seed) from "
                            "those loaded, the k-th draw of job J renamed J~k (default: each "
                            "loaded job once, in file order)")
    group.add_argument("--max-turns", type=positive_int, default=None, metavar="N",
                       help="truncate jobs to N turns (default: keep all)")
    group.add_argument("--repeat-turns", type=positive_int, default=1, metavar="K",
                       help="the paper's turn scaling: repeat each job's turns K times, token "
                            "counts divided by K, joined by the job's median tool call "
                            "(default: 1)")
    group.add_argument("--token-scale", type=float, default=1.0,
                       help="multiply every token count, to fit a small model (default: 1)")
    group.add_argument("--output-tokens-per-turn", type=int, default=80,
                       help="splits context_tokens_after traces (default: 80)")
    group.add_argument("--tool-quantiles", default=None,
                       help=f"synthesizes missing tool durations (default: {QUANTILES_FILE} "
                            "beside the trace, if there; the shipped one for a --workload)")
    group.add_argument("--seed", type=int, default=0,
                       help="seed of arrivals, draws, synthesized durations and prompts "
                            "(default: 0)")


def load_workload(args: argparse.Namespace) -> list[AgentJobSpec]:
    """The jobs the workload flags select: the first `--first-jobs` of the trace, truncated
    to `--max-turns`, scaled, repeated `--repeat-turns` times, then `--num-jobs` drawn with
    replacement. ValueError with the reason if they cannot be read."""
    source = workload_source(args)
    quantiles = args.tool_quantiles
    if quantiles is None and (source.path.parent / QUANTILES_FILE).exists():
        quantiles = source.path.parent / QUANTILES_FILE
    sampler = None if quantiles is None else ToolDurationSampler.from_file(quantiles)
    options = LoadOptions(max_jobs=args.first_jobs, max_turns=args.max_turns,
                          output_tokens_per_turn=args.output_tokens_per_turn,
                          token_scale=args.token_scale, repeat_turns=args.repeat_turns,
                          seed=args.seed)
    jobs = load_jobs(source.path, options, tool_durations=sampler)
    return jobs if args.num_jobs is None else draw_jobs(jobs, args.num_jobs, seed=args.seed)


def workload_summary(jobs: list[AgentJobSpec]) -> dict:
    """What the loaded jobs hold, for a report's `workload` field."""
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
