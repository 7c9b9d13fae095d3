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


def _setup_extras() -> set[str]:
    """The extras `scripts/setup.sh` installs besides those it is asked for."""
    import re
    text = (ROOT / "scripts" / "setup.sh").read_text()
    match = re.search(r'^requested=\(([^)]*)\)', text, re.MULTILINE)
    assert match is not None
    return {word for word in match.group(1).split() if not word.startswith('"')}


def _requirement_closure(distribution: str, extras: set[str]) -> set[str]:
    """`distribution` and every distribution its requirements (unconditional, or of
    `extras`) pull in, normalised names."""
    from importlib import metadata

    from packaging.requirements import Requirement

    seen: set[str] = set()
    pending = [distribution]
    while pending:
        name = pending.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requires:
            requirement = Requirement(text)
            if requirement.marker is None or any(
                    requirement.marker.evaluate({"extra": extra}) for extra in {"", *extras}):
                pending.append(requirement.name)
        extras = set()  # a requirement's own extras are not followed
    return seen


_BLOCKING_IMPORTER = """
import importlib, importlib.abc, sys
from importlib import metadata
allowed = set(sys.argv[2].split(","))
owners = metadata.packages_distributions()

class OnlyDeclared(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        found = {owner.lower().replace("_", "-") for owner in owners.get(top, ())}
        if found and not found & allowed:
            raise ModuleNotFoundError(f"{top} is not a declared dependency", name=name)
        return None

sys.meta_path.insert(0, OnlyDeclared())
module = importlib.import_module(sys.argv[1])
parser = __import__("argparse").ArgumentParser()
module.add_arguments(parser)
"""


@pytest.mark.parametrize("command", ["agent", "sim"])
def test_a_user_bench_command_needs_only_declared_dependencies(command: str) -> None:
    # The README's set-up installs the package's requirements and the extras setup.sh names,
    # not the dev extra: the command must import with every other distribution hidden
    # (httpx once was missing).
    declared = _requirement_closure("continuum-engine", _setup_extras())
    result = subprocess.run(
        [sys.executable, "-c", _BLOCKING_IMPORTER, f"eval.bench.{command}",
         ",".join(sorted(declared))], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
