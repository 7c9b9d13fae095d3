"""The `continuum` console script.

Subcommands are named here as `module` paths and imported only when run, so `continuum --help`
stays fast and heavy dependencies load only for the command that needs them. Each command
module provides `add_arguments(parser)` and `main(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMANDS: dict[str, tuple[str, str] | dict[str, tuple[str, str]]] = {
    "serve": ("engine.entrypoints.serve", "the OpenAI-compatible HTTP server"),
    "bench": {
        "scheduler": ("engine.bench.scheduler", "CPU cost of one scheduler step"),
        "forward": ("engine.bench.forward", "model runner steps at fixed decode, prefill shapes"),
        "throughput": ("engine.bench.throughput", "offline LLM.generate vs transformers"),
        "estimator": ("eval.bench_estimator", "TTL estimators replayed over an agent trace"),
        "agent": ("eval.bench_agent", "agent jobs replayed against an OpenAI-compatible server"),
        "sim": ("eval.bench_sim", "policies compared on an agent trace in simulated time"),
        "calibrate": ("eval.bench_calibrate", "a measured cost profile for `bench sim`, "
                      "fitted to the step traces of a real run"),
        "check-calibration": ("eval.calibration_check", "a cost profile's simulation of the "
                              "shipped GPU runs against their measurements"),
        "load": ("eval.bench_load", "load test of a `continuum serve` subprocess: leaks, "
                 "pins, memory"),
        "soak": ("eval.bench_soak", "agent replay for minutes with the invariant checker on"),
        "connections": ("eval.bench_connections", "slow and many clients against a "
                        "`continuum serve` subprocess: timeouts, cap, descriptors"),
        "structured": ("eval.bench_structured", "structured outputs: step cost, grammar "
                                                "compile time"),
        "workloads": ("eval.bench_workloads", "the named workloads that ship with the package"),
    },
    "trace": {
        "summarize": ("tracing.summary", "per-job, per-turn, cache and pin figures of a trace"),
        "timeline": ("tracing.timeline", "a PNG of jobs over time and the block pool"),
        "compare": ("tracing.compare", "two traces' summaries side by side"),
    },
}


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """The parser; only the subcommand named in `argv` has its module imported."""
    parser = argparse.ArgumentParser(prog="continuum", description=__doc__.splitlines()[0])
    groups = parser.add_subparsers(dest="group", required=True, metavar="COMMAND")
    for group, commands in COMMANDS.items():
        if isinstance(commands, tuple):
            _add_command(groups, group, commands, selected=list(argv[:1]) == [group])
            continue
        group_parser = groups.add_parser(group, help=f"{group} commands")
        subparsers = group_parser.add_subparsers(dest="command", required=True, metavar="NAME")
        for name, command in commands.items():
            _add_command(subparsers, name, command, selected=list(argv[:2]) == [group, name])
    return parser


def _add_command(
    subparsers: argparse._SubParsersAction, name: str, command: tuple[str, str], *,
    selected: bool,
) -> None:
    module_path, help_text = command
    sub = subparsers.add_parser(name, help=help_text)
    if selected:
        module = importlib.import_module(module_path)
        module.add_arguments(sub)
        sub.set_defaults(run=module.main)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
