"""The lab apart from the product: `python -m lab` runs the lab's commands, one module each,
`continuum bench` lists none of them, and the wheel's packages hold none of the lab."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import tomllib
from setuptools import find_packages

from engine.cli import COMMANDS as PRODUCT_COMMANDS
from lab import LAB_COMMANDS
from lab.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[2]


def test_each_lab_command_is_the_module_named_after_it() -> None:
    modules = {path.stem for path in (ROOT / "lab" / "bench").glob("*.py")} - {"__init__"}
    assert {name.replace("-", "_") for name in LAB_COMMANDS} == modules
    for name, (module_path, help_text) in COMMANDS.items():
        module = importlib.import_module(module_path)
        assert module_path == f"lab.bench.{name.replace('-', '_')}"
        assert help_text == LAB_COMMANDS[name]
        assert callable(module.add_arguments) and callable(module.main)


def test_the_lab_runs_from_the_checkout_and_the_product_lists_none_of_it() -> None:
    lab_help = subprocess.run([sys.executable, "-m", "lab", "--help"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout
    bench_help = subprocess.run([sys.executable, "-m", "engine.cli", "bench", "--help"],
                                cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in LAB_COMMANDS:
        assert name in lab_help
        assert name not in PRODUCT_COMMANDS["bench"]
        assert f"\n    {name} " not in bench_help


def test_the_wheel_ships_no_lab_module() -> None:
    """The packages `pip wheel .` takes, by pyproject.toml's own find settings."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]
    shipped = find_packages(str(ROOT), include=find["include"], exclude=find["exclude"])
    assert "eval.bench" in shipped and "engine" in shipped
    assert not [package for package in shipped
                if package.split(".")[0] == "lab" or package.startswith("eval.gpu")]
    lab_modules = {path.stem for path in (ROOT / "lab").rglob("*.py")} - {"__init__",
                                                                          "__main__", "cli"}
    harness_modules = {path.stem for package in shipped if package.split(".")[0] == "eval"
                       for path in (ROOT / package.replace(".", "/")).glob("*.py")}
    assert not lab_modules & harness_modules
