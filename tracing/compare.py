"""`continuum trace compare A B`: two traces' summaries side by side, with B / A."""

from __future__ import annotations

import argparse

from tracing.reader import read_trace_or_exit
from tracing.stdout import print_report
from tracing.summary import TraceSummary, format_table, format_value, summarize, write_json


def compare(a: TraceSummary, b: TraceSummary) -> dict[str, dict[str, float | int | None]]:
    """Per figure (dotted name, union of both): A's value, B's, and B / A when both are
    numbers and A is not 0."""
    scalars_a, scalars_b = a.scalars(), b.scalars()
    names = list(scalars_a) + [name for name in scalars_b if name not in scalars_a]
    rows = {}
    for name in names:
        value_a, value_b = scalars_a.get(name), scalars_b.get(name)
        ratio = None
        if value_a is not None and value_b is not None and value_a != 0:
            ratio = value_b / value_a
        rows[name] = {"a": value_a, "b": value_b, "b_over_a": ratio}
    return rows


def render(a: TraceSummary, b: TraceSummary) -> str:
    header = f"A: {a.path} (policy {a.policy})\nB: {b.path} (policy {b.policy})\n"
    rows = [("figure", "A", "B", "B/A")]
    rows += [
        (name, format_value(row["a"]), format_value(row["b"]), format_value(row["b_over_a"]))
        for name, row in compare(a, b).items()
    ]
    return header + format_table(rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace_a", help="the baseline trace (A)")
    parser.add_argument("trace_b", help="the trace compared with it (B)")
    parser.add_argument("--json", dest="json_path", default=None,
                        help="also write both summaries and the comparison here")


def main(args: argparse.Namespace) -> int:
    a = summarize(read_trace_or_exit(args.trace_a))
    b = summarize(read_trace_or_exit(args.trace_b))
    status = print_report(render(a, b))
    if args.json_path is not None:
        write_json({"a": a, "b": b, "figures": compare(a, b)}, args.json_path)
    return status
