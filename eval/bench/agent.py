"""`continuum bench agent`: agent jobs replayed against a running OpenAI-compatible server.

Prints the run's figures; `--json` writes them in the `bench sim` layout (one run, named by
`--label`), so `eval.report` tables and plots take both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from eval.arrivals import arrivals_s
from eval.replay_client import PROMPT_FORMATS, AgentReplay, ReplaySettings
from eval.replay_metrics import JobRecord, RunMetrics
from eval.report import markdown_table
from eval.workload import AgentJobSpec
from eval.workload_flags import add_workload_arguments, load_workload, workload_summary
from eval.workloads import workload_source


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True,
                        help="the server, e.g. http://127.0.0.1:8000 (or .../v1, as "
                             "OpenAI clients take it)")
    add_workload_arguments(parser)
    parser.add_argument("--jobs-per-s", type=float, default=None,
                        help="Poisson arrivals at this rate (default: all jobs at once)")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--api-key", default="EMPTY")
    parser.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="ids",
                        help="token-id prompts, or words for servers that take no ids")
    parser.add_argument("--vocab-size", type=int, default=256,
                        help="prompt token ids are drawn from [1, N) (default: 256)")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds one turn may take (default: 600)")
    parser.add_argument("--stop-after-s", type=float, default=None,
                        help="stop the replay this many seconds after it started, cancelling "
                             "the turns in flight; jobs not finished by then count as "
                             "unfinished (default: run every job to its end)")
    parser.add_argument("--label", default="server",
                        help="names the run in the table and JSON, e.g. the server's policy")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", default=None, help="write the run's figures here")


def run_replay(args: argparse.Namespace
               ) -> tuple[RunMetrics, list[AgentJobSpec], list[JobRecord]]:
    """The replay's figures, the jobs replayed and their records."""
    jobs = load_workload(args)
    settings = ReplaySettings(base_url=args.base_url, model=args.model, api_key=args.api_key,
                              prompt_format=args.prompt_format, vocab_size=args.vocab_size,
                              request_timeout_s=args.request_timeout, seed=args.seed)
    with tqdm(total=len(jobs), unit="job", disable=args.no_progress) as progress:
        replay = AgentReplay(jobs, arrivals_s(len(jobs), args.jobs_per_s, seed=args.seed),
                             settings, on_job_done=lambda record: progress.update())
        return asyncio.run(replay.run(args.stop_after_s)), jobs, replay.records


def main(args: argparse.Namespace) -> int:
    try:
        metrics, jobs, records = run_replay(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    run = {"label": args.label, "policy": args.label, "jobs_per_s": args.jobs_per_s,
           "stop_after_s": args.stop_after_s, **metrics.to_dict()}
    print(markdown_table([run]))
    stopped = "" if args.stop_after_s is None else f" by {args.stop_after_s:g} s (stopped)"
    print(f"jobs finished {metrics.num_finished_jobs}/{metrics.num_jobs}{stopped}, failures "
          f"{metrics.failures}, {metrics.throughput_jobs_per_s:.3f} jobs/s, "
          f"{metrics.tokens_per_s:.1f} generated tokens/s, mean TTFT "
          f"{metrics.mean_ttft_s or 0.0:.3f} s")
    replicas = replica_summary(records)
    if replicas is not None:
        print(replicas)
    if args.json:
        report = {"base_url": args.base_url, "trace": workload_source(args).label,
                  "workload": workload_summary(jobs), "runs": [run]}
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if metrics.failures == 0 else 1


def replica_summary(records: list[JobRecord]) -> str | None:
    """Where a replicated server ran the turns (None for a server that names no replica):
    turns per replica, and the jobs whose turns all ran on one replica."""
    turns = Counter(replica for record in records for replica in record.replica_ids)
    if not turns:
        return None
    on_one = sum(1 for record in records if len(set(record.replica_ids)) == 1)
    split = ", ".join(f"{replica} {count}" for replica, count in sorted(turns.items()))
    return f"turns by replica: {split}; jobs on one replica {on_one}/{len(records)}"
