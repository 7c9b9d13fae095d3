"""`scripts/gpu_bench.sh --dry-run`: every step a device call would run, each engine command
parsed and its config built here, so that a flag a late step mistypes fails on this CPU
rather than in a device call's last minutes."""

import argparse
import json
import os
import shlex
import subprocess
import sys
import tarfile
from dataclasses import replace
from pathlib import Path

import pytest

from engine.cli import build_parser
from engine.engine_args import EngineArgs
from lab.bench import forward
from lab.cli import COMMANDS as LAB_COMMANDS

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "engine/model/configs"
CONFIG = CONFIGS / "llama3.1-8b.json"


def _dry_run(out: Path, *flags: str) -> list[tuple[str, list[str]]]:
    """Each command's name and words, in order (an agent replay prints two: its server's
    and its client's)."""
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    result = subprocess.run(["bash", "scripts/gpu_bench.sh", "--dry-run", *flags], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    commands = []
    for line in result.stdout.splitlines():
        if line.startswith("== dry run "):
            name, command = line.removeprefix("== dry run ").split(": ", 1)
            commands.append((name, shlex.split(command)))
    names = [name for name, _ in commands]
    assert len(names) == len(set(names)), "two steps would write the same raw/NAME.json"
    return commands


def _model_dirs(root: Path) -> dict[str, Path]:
    """A model directory for each shipped config (its name without .json), as the script
    makes them in its scratch folder."""
    dirs = {}
    for config in CONFIGS.glob("*.json"):
        dirs[config.stem] = root / config.stem
        dirs[config.stem].mkdir(parents=True)
        (dirs[config.stem] / "config.json").write_text(config.read_text())
    return dirs


def _check_engine_command(argv: list[str], model_dirs: dict[str, Path]) -> None:
    """Parses `continuum ARGV` and builds the engine config it would run with; the shipped
    config of the same name stands in for the model directory the script makes in its
    scratch folder (the 8B's for a directory of another name)."""
    if "--model" in argv:
        argv = [*argv]
        index = argv.index("--model") + 1
        argv[index] = str(model_dirs.get(Path(argv[index]).name, model_dirs["llama3.1-8b"]))
    args = build_parser(argv).parse_args(argv)
    if argv[:2] == ["bench", "throughput"] or argv[:1] == ["serve"]:
        EngineArgs.from_cli_args(args).to_engine_config()
    # A client, or a command over the run's own files: its flags parsed is all there is.
    elif argv[:2] not in (["bench", "agent"], ["bench", "calibrate"]):
        pytest.fail(f"a step runs an engine command this test does not check: {argv[:2]}")


def _check_lab_command(argv: list[str], model_dirs: dict[str, Path]) -> None:
    """Parses `python -m lab ARGV`; for `forward`, builds the config it would run with."""
    args = build_parser(argv, LAB_COMMANDS).parse_args(argv)
    if argv[:1] == ["forward"]:
        _check_forward(args, model_dirs["llama3.1-8b"].parent)
    elif argv[:1] != ["check-calibration"]:  # over the run's own files: its flags parsed
        pytest.fail(f"a step runs a lab command this test does not check: {argv[:1]}")


def _check_forward(args: argparse.Namespace, scratch: Path) -> None:
    """The runner config `bench forward` would build for its shapes, over its own `--config`
    copied into a scratch folder as the command does."""
    shapes = [replace(shape, sampling=sampling)
              for shape in [*args.decode, *args.prefill, *args.extend]
              for sampling in dict.fromkeys(args.sampling)]
    assert shapes
    model_dir = scratch / "forward"
    model_dir.mkdir(exist_ok=True)
    forward._engine_config(args, forward._model_dir(args, model_dir), shapes)


def _check_commands(commands: list[tuple[str, list[str]]], model_dirs: dict[str, Path]) -> None:
    """Each engine command parsed and its config built; each test and script there."""
    for name, command in commands:
        if "engine.cli" in command:
            _check_engine_command(command[command.index("engine.cli") + 1:], model_dirs)
        elif "lab" in command and command[command.index("lab") - 1] == "-m":
            _check_lab_command(command[command.index("lab") + 1:], model_dirs)
        elif "pytest" in command:
            tests = [word for word in command if word.startswith("tests/")]
            assert tests and all((REPO / test).is_file() for test in tests), name
        else:
            scripts = [word for word in command if word.startswith(("scripts/", "eval/gpu/"))]
            assert scripts and all((REPO / script).is_file() for script in scripts), name


@pytest.mark.parametrize("mode", [("--quick",), ("--part", "agent")], ids=["quick", "full"])
def test_every_engine_command_of_a_run_parses_and_builds_its_config(
        tmp_path: Path, mode: tuple[str, ...]) -> None:
    commands = _dry_run(tmp_path / "out", *mode, "--part", "smoke", "--part", "kernels",
                        "--part", "forward", "--part", "throughput")
    names = [name for name, _ in commands]
    assert names[0] == "smoke-tests"
    assert "throughput-triton-fp8-all-256" in names
    assert ("agent-swe24-continuum" in names) == ("--quick" not in mode)
    _check_commands(commands, _model_dirs(tmp_path / "models"))
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "dry run" in summary


def _flag_values(command: list[str], flag: str) -> list[str]:
    """The words after `flag` up to the next flag."""
    start = command.index(flag) + 1
    end = next((i for i in range(start, len(command)) if command[i].startswith("--")),
               len(command))
    return command[start:end]


def test_the_70b_and_paper_parts_parse_and_calibrate_on_the_8b_runs(tmp_path: Path) -> None:
    commands = _dry_run(tmp_path / "out", "--part", "70b", "--part", "paper",
                        "--engine-commit", "abc1234")
    _check_commands(commands, _model_dirs(tmp_path / "models"))
    by_name = dict(commands)
    forward_70b = by_name["forward-70b-fp8-all"]
    assert Path(_flag_values(forward_70b, "--config")[0]).name == "llama3.1-70b.json"
    assert _flag_values(forward_70b, "--decode") == ["1x1024", "32x1024"]
    serve_70b = by_name["paper-70b-swe-1jps-continuum-serve"]
    assert Path(_flag_values(serve_70b, "--model")[0]).name == "llama3.1-70b"
    assert _flag_values(serve_70b, "--quantization") == ["fp8"]
    assert _flag_values(serve_70b, "--kv-cache-dtype") == ["fp8"]
    # Every model, workload, load and policy, a load's highest first; then the report and
    # the calibration.
    replays = [name for name in by_name if name.startswith("paper-") and "-serve" not in name
               and "jps-" in name]
    assert len(replays) == 2 * 2 * 3 * 3
    assert replays[:3] == ["paper-8b-swe-4jps-fcfs", "paper-8b-swe-4jps-continuum-fixed",
                           "paper-8b-swe-4jps-continuum"]
    assert [name for name, _ in commands][-4:] == [
        "paper-report", "paper-calibrate", "paper-check-manifest", "paper-check-calibration"]
    calibrate = by_name["paper-calibrate"]
    fitted, held_out = _flag_values(calibrate, "--trace"), _flag_values(calibrate, "--check")
    assert len(fitted) == 12 and len(held_out) == 6
    assert all("-8b-" in trace for trace in fitted + held_out)
    assert all("-2jps-" in trace for trace in held_out)
    assert not any("-2jps-" in trace for trace in fitted)
    assert _flag_values(calibrate, "--name") == ["gpu-llama3.1-8b-abc1234"]
    # The analysis ran on the stand-in (the runs simulated): every model and workload judged
    # at a load, the figure drawn, the held-out runs checked against the fitted profile.
    out = tmp_path / "out"
    judged = json.loads((out / "paper.json").read_text())
    assert {(group["model"], group["workload"]) for group in judged} == {
        (model, workload) for model in ("8b", "70b") for workload in ("swe", "bfcl")}
    for group in judged:
        assert group["judged_load"] is not None
        assert set(group["runs"]) == {"0.25", "0.5", "1"} if group["model"] == "70b" else {
            "1", "2", "4"}
        assert len(group["targets"]) == 2 + 2 * 3
        assert all(target["met"] is not None for target in group["targets"])
    assert "| not worse than fcfs at" in (out / "paper.md").read_text()
    pytest.importorskip("matplotlib")
    assert (out / "paper-jct.png").stat().st_size > 0
    with tarfile.open(out / "raw.tar.gz") as raw:
        checked = json.load(raw.extractfile("raw/paper-check-calibration.json"))
        profile = json.load(raw.extractfile("raw/paper-profile.json"))
    assert profile["name"] == "gpu-llama3.1-8b-abc1234"
    assert sorted((run["setup"], run["policy"]) for run in checked["runs"]) == sorted(
        (f"8b-{workload}-2jps", policy) for workload in ("swe", "bfcl")
        for policy in ("fcfs", "continuum-fixed", "continuum"))
    assert all(run["measured_jct_s"] is not None and run["simulated_jct_s"] is not None
               for run in checked["runs"])


def test_a_paper_share_of_one_call_runs_only_its_loads(tmp_path: Path) -> None:
    commands = _dry_run(tmp_path / "out", "--part", "paper", "--paper-models", "8b",
                        "--paper-workloads", "bfcl", "--paper-loads", "3")
    names = [name for name, _ in commands]
    assert [name for name in names if not name.endswith("-serve")] == [
        "paper-8b-bfcl-4jps-fcfs", "paper-8b-bfcl-4jps-continuum-fixed",
        "paper-8b-bfcl-4jps-continuum", "paper-report", "paper-calibrate"]
    result = subprocess.run(["bash", "scripts/gpu_bench.sh", "--dry-run", "--part", "paper",
                             "--paper-loads", "4"], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "OUT": str(tmp_path / "bad"),
                                 "PYTHON": sys.executable})
    assert result.returncode == 2
    assert "expected a comma-separated list of 1, 2, 3" in result.stderr


def test_the_quick_run_starts_with_the_targets_runs(tmp_path: Path) -> None:
    names = [name for name, _ in _dry_run(tmp_path / "out", "--quick")]
    assert names[:4] == ["forward-triton", "throughput-triton-256",
                         "forward-triton-sdpa", "throughput-triton-sdpa-256"]
