"""`python -m lab ingress`: its flags, and a short run against a real `continuum serve`
subprocess (a single server; the replicated ingress's key check is tested in
`tests/engine/replicas/test_ray_app.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.cli import main as cli_main


@pytest.mark.parametrize("args", [["--clients", "0"], ["--bodies", "0"], ["--body-mib", "0"],
                                  ["--serve-args", "--model tiny"]])
def test_bad_flags_are_refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["ingress", *args]) == 2
    assert capsys.readouterr().err.startswith("error:")


def test_requests_without_a_key_are_refused_before_their_bodies_are_read(tmp_path: Path) -> None:
    out = tmp_path / "ingress.json"
    assert cli_main(["ingress", "--clients", "2", "--bodies", "2", "--body-mib", "8",
                     "--json", str(out), "--serve-args",
                     "--model tiny --max-model-len 2048 --num-kv-blocks 256 --api-key k"]) == 0
    report = json.loads(out.read_text())
    assert [check["passed"] for check in report["checks"]] == [True, True]
    figures = report["figures"]
    assert figures["requests without a key"] == 4 and figures["answers by status"] == "401 4"
    assert figures["body bytes written (MiB)"] < 24  # of 32: answered before the bodies ended
