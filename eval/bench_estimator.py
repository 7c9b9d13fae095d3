"""`continuum bench estimator`: `estimator.bench` over a named workload or a trace file.

The replay, its scorings and its options are `estimator.bench`'s. The estimator package reads
trace files only and never imports `eval`, so this command resolves `--workload NAME` to the
shipped file (`eval.workloads`) and hands the path on.
"""

from __future__ import annotations

import argparse
import sys

from estimator import bench
from eval.workloads import add_trace_arguments, workload_source


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trace_arguments(parser)
    bench.add_options(parser)


def main(args: argparse.Namespace) -> int:
    try:
        source = workload_source(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return bench.main(argparse.Namespace(**{**vars(args), "trace": str(source.path)}))
