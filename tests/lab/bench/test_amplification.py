"""`python -m lab amplification`: the reproduction's request by default, refused counts, and
a reduced run against a real `continuum serve` subprocess."""

from __future__ import annotations

import argparse
import re

import pytest

from lab.bench.amplification import AmplificationSettings, add_arguments, request_body
from lab.cli import main as cli_main
from lab.flags import settings_from_args


def parse(args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(args)


def test_the_default_request_is_the_reproductions_13_6_mb_body() -> None:
    body = request_body(settings_from_args(AmplificationSettings, parse([])))
    assert body == request_body(AmplificationSettings())
    assert body["prompt"] == ["a", "b", "c", "d"] and body["n"] == 16
    assert body["max_tokens"] == 4 and body["model"] == "tiny"
    assert [stop[0] for stop in body["stop"]] == list("ABCDEFGHIJKLMNOP")
    assert {len(stop) for stop in body["stop"]} == {850_000}
    assert round(len(str(body)) / 1e6, 1) == 13.6
    assert parse([]).serve_args == "--num-kv-blocks 512"


@pytest.mark.parametrize("args", [["--prompts", "0"], ["--stop-strings", "27"], ["-n", "0"],
                                  ["--serve-args", "--port 8000"]])
def test_bad_flags_are_refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["amplification", *args]) == 2
    assert capsys.readouterr().err.startswith("error:")


def test_a_reduced_request_reports_each_process_before_and_after(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli_main(["amplification", "--stop-chars", "1000",
                     "--serve-args", "--num-kv-blocks 256 --max-model-len 1024"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "| status | 200 |" in lines and "| body MB | 0.0 |" in lines
    assert "| answered 200 | PASS | status 200 |" in lines
    processes = [line for line in lines if re.search(r" [\d.]+ -> [\d.]+ MiB \|$", line)]
    assert len(processes) >= 2 and any("engine.cli serve" in line for line in processes)
