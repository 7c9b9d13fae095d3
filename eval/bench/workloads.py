"""`continuum bench workloads`: the named workloads that ship with the package.

Prints one row per workload: its name (for `--workload`), file, kind, how many jobs (or
sessions) and turns the file holds, its source and licence (`eval/workloads/SOURCES.md`).
"""

from __future__ import annotations

import argparse

from eval.workloads import WORKLOADS, count_records

COLUMNS = ("name", "file", "kind", "jobs or sessions", "turns", "source", "licence")


def workload_rows() -> list[tuple[str, ...]]:
    """One row of `COLUMNS` per named workload, in registry order."""
    rows = []
    for workload in WORKLOADS.values():
        counts = count_records(workload.path)
        rows.append((workload.name, workload.file_name, workload.kind,
                     f"{counts.num_records:,}", f"{counts.num_turns:,}", workload.source,
                     workload.licence))
    return rows


def markdown(rows: list[tuple[str, ...]]) -> str:
    """`rows` under `COLUMNS` as a markdown table."""
    lines = [COLUMNS, ("---",) * len(COLUMNS), *rows]
    return "\n".join(f"| {' | '.join(line)} |" for line in lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options."""


def main(args: argparse.Namespace) -> int:
    print(markdown(workload_rows()))
    return 0
