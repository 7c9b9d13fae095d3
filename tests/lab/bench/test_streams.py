"""`python -m lab streams`: its flags, and a reduced run against a real `continuum serve`
subprocess that reads every stream to its end and the API server's memory around them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.bench.streams import StreamSettings, stream_body
from lab.cli import main as cli_main


def test_the_default_streams_are_two_of_1024_tokens_with_20_logprobs() -> None:
    settings = StreamSettings()
    assert (settings.streams, settings.tokens, settings.logprobs) == (2, 1024, 20)
    body = stream_body(settings, 1)
    assert body["stream"] is True and body["ignore_eos"] is True
    assert body["max_tokens"] == 1024 and body["logprobs"] == 20


@pytest.mark.parametrize("args", [["--streams", "0"], ["--late-readers", "3"],
                                  ["--max-settled-ratio", "0.9"],
                                  ["--serve-args", "--port 8000"]])
def test_bad_flags_are_refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["streams", *args]) == 2
    assert capsys.readouterr().err.startswith("error:")


def test_a_reduced_run_reads_every_stream_and_reports_the_servers_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    report = tmp_path / "streams.json"
    assert cli_main(["streams", "--tokens", "64", "--logprobs", "5", "--settle-s", "0",
                     "--json", str(report),
                     "--serve-args", "--num-kv-blocks 256 --max-model-len 1024"]) == 0
    out = capsys.readouterr().out
    assert "| streams: tokens | 64, 64 |" in out
    assert "| every stream ended with [DONE] after its tokens | PASS |" in out
    figures = json.loads(report.read_text())["figures"]
    start, peak, ended = (float(value) for value in figures[
        "API server RSS start / peak / streams ended, MiB"].split(" / "))
    assert 0 < start <= peak and ended > 0
