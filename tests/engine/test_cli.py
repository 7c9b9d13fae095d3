import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli import main
from eval.bench import BENCH_COMMANDS

ROOT = Path(__file__).resolve().parents[2]


def test_console_script_help_lists_every_bench_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "engine.cli", "bench", "--help"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )
    for name, help_text in BENCH_COMMANDS.items():
        assert name in result.stdout and help_text.split()[0] in result.stdout


def test_unknown_command_exits_with_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as excinfo:
        main(["bench", "nope"])
    assert excinfo.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
