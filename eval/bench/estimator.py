"""`continuum bench estimator`: TTL estimators replayed over the tool calls of a named
workload or a trace file, under two scorings.

The replay and its scorings are `estimator.replay`'s (the estimator package reads trace files
only and never imports `eval`, so this command resolves `--workload NAME` to the shipped
file). Prints one table per scoring, a row per estimator and the oracle's last; `--json`
writes every report.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from estimator.cost_model import H100_LLAMA_8B_PREFILL, PrefillCostModel, read_prefill_profile
from estimator.replay import compare_estimators
from estimator.traces import read_trace_jobs
from estimator.ttl_estimator import MAX_OBSERVED_S
from eval.report import write_json_report
from eval.workloads import add_trace_arguments, workload_source

NEW_COLUMNS = ("pin_rate", "hit_rate", "reuse_rate", "wasted_pin_s", "mean_ttl_s",
               "mean_held_s", "mean_T_s", "mean_utility", "pinball_loss")
OLD_COLUMNS = ("pin_rate", "hit_rate", "reuse_rate", "wasted_pin_s", "mean_ttl_s",
               "mean_utility_ttl_cost_handed_T", "mean_utility_handed_T")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trace_arguments(parser)
    parser.add_argument("--json", dest="json_path", help="write the results here as JSON")
    parser.add_argument("--train-fraction", type=float, default=0.7,
                        help="the earliest jobs (by arrival) estimators learn from")
    parser.add_argument("--queueing-delay-s", type=float, default=2.0,
                        help="T: the queueing delay a turn without its KV would suffer")
    parser.add_argument("--prefill-profile",
                        help="(num_tokens, seconds) prefill points to fit R to; default: a "
                             "roofline estimate of Llama-3.1-8B on one H100")
    parser.add_argument("--max-jobs", type=int, help="only the first N jobs of the trace")


def main(args: argparse.Namespace) -> int:
    try:
        trace = str(workload_source(args).path)
        if args.max_jobs is not None and args.max_jobs < 1:
            raise ValueError(f"--max-jobs must be >= 1, got {args.max_jobs}")
        if not 0 <= args.queueing_delay_s <= MAX_OBSERVED_S:
            raise ValueError(f"--queueing-delay-s must be in [0, {MAX_OBSERVED_S}], "
                             f"got {args.queueing_delay_s}")
        jobs = read_trace_jobs(trace)[: args.max_jobs]
        prefill_cost = (H100_LLAMA_8B_PREFILL if args.prefill_profile is None
                        else PrefillCostModel.fit(read_prefill_profile(args.prefill_profile)))
        results = compare_estimators(jobs, train_fraction=args.train_fraction,
                                     queueing_delay_s=args.queueing_delay_s,
                                     prefill_cost=prefill_cost)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"{trace}: {len(jobs)} jobs, train fraction {args.train_fraction}, "
          f"T = {args.queueing_delay_s} s")
    print("new scoring (mean_utility): a used pin costs min(duration, TTL); "
          "the estimator learns T from misses")
    _print_table(results, NEW_COLUMNS)
    print("old scoring (mean_utility_ttl_cost_handed_T): a pin costs its whole TTL; "
          "the estimator is handed T")
    _print_table({name: _handed_row(report) for name, report in results.items()}, OLD_COLUMNS)
    if args.json_path:
        write_json_report(args.json_path, results)
    return 0


def _handed_row(report: dict[str, Any]) -> dict[str, Any]:
    """A report's handed-`T` replay statistics with its handed-`T` utilities."""
    return {**report["handed_T"],
            "mean_utility_ttl_cost_handed_T": report["mean_utility_ttl_cost_handed_T"],
            "mean_utility_handed_T": report["mean_utility_handed_T"]}


def _print_table(rows: dict[str, dict[str, Any]], columns: Sequence[str]) -> None:
    widths = [max(10, len(column)) + 2 for column in columns]
    name_width = max(14, *(len(name) + 2 for name in rows))
    print(f"  {'estimator':<{name_width}}"
          + "".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True)))
    for name, row in rows.items():
        cells = "".join(
            f"{row[c]:>{w}.4f}" if isinstance(row.get(c), float) else f"{'-':>{w}}"
            for c, w in zip(columns, widths, strict=True)
        )
        print(f"  {name:<{name_width}}" + cells)
