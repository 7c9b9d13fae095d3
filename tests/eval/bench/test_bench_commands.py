"""`eval.bench.BENCH_COMMANDS`: one module per command, named after it, and a mapping that
loads nothing of the project, so that `continuum --help` stays fast."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

from engine.cli import COMMANDS
from eval.bench import BENCH_COMMANDS

ROOT = Path(__file__).resolve().parents[3]


def test_each_command_is_the_module_named_after_it() -> None:
    modules = {path.stem for path in (ROOT / "eval" / "bench").glob("*.py")} - {"__init__"}
    assert {name.replace("-", "_") for name in BENCH_COMMANDS} == modules
    assert list(COMMANDS["bench"]) == list(BENCH_COMMANDS)
    for name, (module_path, help_text) in COMMANDS["bench"].items():
        module = importlib.import_module(module_path)
        assert module_path == f"eval.bench.{name.replace('-', '_')}"
        assert help_text == BENCH_COMMANDS[name]
        assert callable(module.add_arguments) and callable(module.main)


def test_the_mapping_imports_no_project_module_and_no_torch() -> None:
    code = ("import sys, eval.bench; print(sorted({name.split('.')[0] for name in sys.modules"
            " if name.split('.')[0] in {'torch', 'engine', 'estimator', 'continuum', "
            "'tracing', 'httpx', 'numpy'}}))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, check=True)
    assert result.stdout.strip() == "[]"
