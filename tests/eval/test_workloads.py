"""The named workloads that ship with the package: their files and the `--workload` flags of
the bench commands (`continuum bench workloads` itself: `tests/eval/bench/test_workloads.py`)."""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import re
from pathlib import Path

import pytest

from engine.cli import build_parser
from engine.cli import main as cli_main
from eval.workload import ToolDurationSampler, load_chat_sessions, load_jobs
from eval.workloads import TOOL_QUANTILES_PATH, WORKLOAD_DIR, WORKLOADS, get_workload
from lab import cli as lab_cli
from tests.continuum.workload import TEST_DATA

ROOT = Path(__file__).resolve().parents[2]
SLICE = TEST_DATA / "minisweagent_deepseek_slice.jsonl"
# sha256 of the converted traces the files were copied from; SOURCES.md lists the same.
SHA256 = {
    "bfcl_multi_turn_base_skeleton.jsonl":
        "3180466f75e2dcfbde3e89a1b8b2e15f9cf7b32dcc3f2af64ba7f4c62a444391",
    "continuum_swesmith_test5_jobs.jsonl":
        "eb2a2e62464654b8e1617502556aa2beba805d62e204590240ac89383ea87542",
    "continuum_upstream_websearch_jobs.jsonl":
        "1e7d236491aee0babf75b1b1f43386ce07d8dd12445bd39d7d0ca85d0e63d8ec",
    "minisweagent_deepseek_jobs.jsonl":
        "898f36d5082fded5596dfba6b46646e020a8b275f63ecf6c657d128c8becf94a",
    "mooncake_conversation_sessions.jsonl":
        "16ad040dc0c2b7e8658202fa6654bd21169885dfc6acf3a4e7d67ffbe257c7e5",
    "tool_duration_quantiles.json":
        "f8bb72a8d6b06b98ae62a69ff5b7403c7522faf441425ec4d5133df8d5ae2d83",
}
# (jobs or sessions, turns) as loaded.
COUNTS = {"swe": (198, 15_881), "web-search": (101, 574), "bfcl": (200, 1_876),
          "swesmith": (5, 125), "mooncake": (8_057, 12_031)}
TRACE_COMMANDS = [
    ["bench", "sim", "--jobs-per-s", "1"],
    ["bench", "agent", "--base-url", "http://127.0.0.1:1"],
    ["lab", "soak"],  # the lab's: `python -m lab soak`
    ["bench", "estimator"],
]


def test_the_shipped_files_are_the_originals_and_sources_lists_them() -> None:
    shipped = {path.name for path in WORKLOAD_DIR.iterdir()
               if path.suffix in (".jsonl", ".json")}
    assert shipped == set(SHA256)
    sources = (WORKLOAD_DIR / "SOURCES.md").read_text()
    for name, digest in SHA256.items():
        assert hashlib.sha256((WORKLOAD_DIR / name).read_bytes()).hexdigest() == digest, name
        assert digest in sources and name in sources
    assert {w.file_name for w in WORKLOADS.values()} | {TOOL_QUANTILES_PATH.name} == shipped


def test_the_package_data_covers_every_shipped_file() -> None:
    # The line `"eval.workloads" = [...]` of [tool.setuptools.package-data]; tomllib is 3.11+.
    line = re.search(r'^"eval\.workloads" = (\[.*\])$', (ROOT / "pyproject.toml").read_text(),
                     re.MULTILINE)
    assert line is not None
    patterns = json.loads(line.group(1))
    for path in WORKLOAD_DIR.iterdir():
        if path.is_file() and path.suffix != ".py":
            assert any(fnmatch.fnmatch(path.name, p) for p in patterns), path.name


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_every_workload_loads_with_its_counts(name: str) -> None:
    workload = get_workload(name)
    if workload.kind == "chat sessions":
        records = load_chat_sessions(workload.path)
    else:
        records = load_jobs(workload.path,
                            tool_durations=ToolDurationSampler.from_file(TOOL_QUANTILES_PATH))
    assert (len(records), sum(len(r.turns) for r in records)) == COUNTS[name]


def test_an_unknown_workload_names_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="unknown workload 'nope'; known: swe, web-search"):
        get_workload("nope")
    for command in TRACE_COMMANDS:
        assert _main([*command, "--workload", "nope"]) == 2
        assert "known: swe, web-search, bfcl, swesmith, mooncake" in capsys.readouterr().err
    assert cli_main(["bench", "sim", "--workload", "swesmith", "--jobs-per-s", "1",
                     "--chat-workload", "nope", "--chat-sessions-per-s", "1"]) == 2
    assert "unknown workload 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("command", TRACE_COMMANDS, ids=lambda c: c[1])
def test_workload_and_trace_are_exclusive_and_one_is_needed(
    command: list[str], capsys: pytest.CaptureFixture[str],
) -> None:
    for extra in (["--workload", "swe", "--trace", str(SLICE)], []):
        argv = [*command, *extra]
        with pytest.raises(SystemExit) as exit_:
            _parse(argv)
        assert exit_.value.code == 2
    errors = capsys.readouterr().err
    assert "not allowed with argument" in errors
    assert "one of the arguments --workload --trace is required" in errors
    argv = [*command, "--workload", "swe"]
    assert _parse(argv).workload == "swe"


def _main(argv: list[str]) -> int:
    """`continuum ARGV`, or `python -m lab ARGV[1:]` for an `argv` that starts with "lab"."""
    return lab_cli.main(argv[1:]) if argv[0] == "lab" else cli_main(argv)


def _parse(argv: list[str]) -> argparse.Namespace:
    """`argv` parsed as `_main` would run it."""
    if argv[0] == "lab":
        return build_parser(argv[1:], lab_cli.COMMANDS).parse_args(argv[1:])
    return build_parser(argv).parse_args(argv)


def test_chat_workload_and_chat_trace_are_exclusive() -> None:
    argv = ["bench", "sim", "--workload", "swe", "--jobs-per-s", "1",
            "--chat-workload", "mooncake", "--chat-trace", str(SLICE)]
    with pytest.raises(SystemExit):
        build_parser(argv).parse_args(argv)


def test_bench_sim_reports_the_workload_names(tmp_path: Path) -> None:
    path = tmp_path / "sim.json"
    assert cli_main(["bench", "sim", "--workload", "swesmith", "--max-turns", "3",
                     "--token-scale", "0.1", "--num-kv-blocks", "512", "--jobs-per-s", "all",
                     "--policies", "fcfs", "--chat-workload", "mooncake",
                     "--chat-sessions-per-s", "1", "--chat-sessions", "2",
                     "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["trace"] == "swesmith" and report["chat"]["trace"] == "mooncake"
    assert report["workload"]["num_jobs"] == 5
