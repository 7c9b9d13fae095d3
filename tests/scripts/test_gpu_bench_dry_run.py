"""`scripts/gpu_bench.sh --dry-run`: every step a device call would run, each engine command
parsed and its config built here, so that a flag a late step mistypes fails on this CPU
rather than in a device call's last minutes."""

import argparse
import os
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from engine.cli import build_parser
from engine.engine_args import EngineArgs
from eval.bench import forward

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "engine/model/configs/llama3.1-8b.json"


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


def _check_engine_command(argv: list[str], model_dir: Path) -> None:
    """Parses `continuum ARGV` and builds the engine config it would run with; the 8B config
    stands in for the model directory the script makes in its scratch folder."""
    if "--model" in argv:
        argv = [*argv]
        argv[argv.index("--model") + 1] = str(model_dir)
    args = build_parser(argv).parse_args(argv)
    if argv[:2] == ["bench", "throughput"] or argv[:1] == ["serve"]:
        EngineArgs.from_cli_args(args).to_engine_config()
    elif argv[:2] == ["bench", "forward"]:
        _check_forward(args, model_dir.parent)
    elif argv[:2] != ["bench", "agent"]:  # a client: its flags parsed is all there is
        pytest.fail(f"a step runs an engine command this test does not check: {argv[:2]}")


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


@pytest.mark.parametrize("mode", [("--quick",), ("--part", "agent")], ids=["quick", "full"])
def test_every_engine_command_of_a_run_parses_and_builds_its_config(
        tmp_path: Path, mode: tuple[str, ...]) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(CONFIG.read_text())
    commands = _dry_run(tmp_path / "out", *mode, "--part", "smoke", "--part", "kernels",
                        "--part", "forward", "--part", "throughput")
    names = [name for name, _ in commands]
    assert names[0] == "smoke-tests"
    assert "throughput-triton-fp8-all-256" in names
    assert ("agent-swe24-continuum" in names) == ("--quick" not in mode)
    for name, command in commands:
        if "engine.cli" in command:
            _check_engine_command(command[command.index("engine.cli") + 1:], model_dir)
        elif "pytest" in command:
            tests = [word for word in command if word.startswith("tests/")]
            assert tests and all((REPO / test).is_file() for test in tests), name
        else:
            scripts = [word for word in command if word.startswith(("scripts/", "eval/gpu/"))]
            assert scripts and all((REPO / script).is_file() for script in scripts), name
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "dry run" in summary


def test_the_quick_run_starts_with_the_targets_runs(tmp_path: Path) -> None:
    names = [name for name, _ in _dry_run(tmp_path / "out", "--quick")]
    assert names[:4] == ["forward-triton", "throughput-triton-256",
                         "forward-triton-sdpa", "throughput-triton-sdpa-256"]
