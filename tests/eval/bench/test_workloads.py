"""`continuum bench workloads`: a row per shipped workload, with its counts and source."""

from __future__ import annotations

import pytest

from engine.cli import main as cli_main
from eval.workloads import WORKLOADS
from tests.eval.test_workloads import COUNTS


def test_bench_workloads_lists_every_workload(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", "workloads"]) == 0
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines()}
    for name, workload in WORKLOADS.items():
        jobs, turns = COUNTS[name]
        for cell in (workload.file_name, workload.kind, f"{jobs:,}", f"{turns:,}",
                     workload.licence):
            assert f" {cell} " in rows[name]
