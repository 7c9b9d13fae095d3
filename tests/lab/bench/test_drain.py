"""`python -m lab drain`: its flags, and a short run against a real `continuum serve`
subprocess (a single server; the replicated one's drain is tested in
`tests/engine/replicas/test_ray_app.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.bench.drain import shutdown_timeout_s
from lab.cli import main as cli_main


def test_the_drain_timeout_is_read_from_the_server_flags() -> None:
    assert shutdown_timeout_s(["--model", "tiny"]) == 30.0
    assert shutdown_timeout_s(["--shutdown-timeout-s", "2", "--shutdown-timeout-s=4"]) == 4.0


@pytest.mark.parametrize("args", [["--streams", "0"], ["--max-tokens", "0"],
                                  ["--probe-after-s", "-1"], ["--serve-args", "--port 8000"]])
def test_bad_flags_are_refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["drain", *args]) == 2
    assert capsys.readouterr().err.startswith("error:")


def test_a_server_drains_its_streams_and_exits(tmp_path: Path) -> None:
    out = tmp_path / "drain.json"
    assert cli_main(["drain", "--streams", "2", "--json", str(out), "--serve-args",
                     "--model tiny --max-model-len 2048 --shutdown-timeout-s 0.5"]) == 0
    report = json.loads(out.read_text())
    assert [check["passed"] for check in report["checks"]] == [True, True, True]
    assert len(report["streams"]) == 2
    for stream in report["streams"]:
        assert stream["kind"] in ("finished", "server_shutting_down")
        assert stream["num_tokens"] >= 1
