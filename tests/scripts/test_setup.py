"""`scripts/setup.sh` runs pip only when pyproject.toml, the interpreter or the extras asked
for changed, run in a copy of the repository whose .venv holds stand-ins for `python` and
`continuum` that record how they were called (pip and the model fetch are not run)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Records each call; answers -VV with $FAKE_PYTHON_VERSION; `-m pip install` exits with
# $FAKE_PIP_STATUS and, on success, leaves the `continuum` console script behind.
FAKE_PYTHON = """#!/usr/bin/env bash
bin=$(dirname "$0")
echo "python $*" >> "$bin/../calls.log"
case $1 in
  -VV) echo "${FAKE_PYTHON_VERSION:-Python 3.11.7}" ;;
  -m) [ "${FAKE_PIP_STATUS:-0}" = 0 ] || exit "$FAKE_PIP_STATUS"
      printf '#!/usr/bin/env bash\\necho "continuum $*" >> "%s/../calls.log"\\n' "$bin" \\
        > "$bin/continuum"
      chmod +x "$bin/continuum" ;;
esac
"""


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return tmp_path


def setup(checkout: Path, *extras: str, **env: str) -> tuple[str, list[str]]:
    """setup.sh's output and the pip installs it ran (their arguments)."""
    log = checkout / ".venv" / "calls.log"
    log.unlink(missing_ok=True)
    result = subprocess.run(["bash", "scripts/setup.sh", *extras], cwd=checkout,
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, **env})
    calls = log.read_text().splitlines() if log.exists() else []
    assert result.returncode == 0, result.stderr
    assert "continuum models pull smollm2-135m-instruct" in calls
    installs = [call.removeprefix("python -m pip install ") for call in calls
                if call.startswith("python -m pip install")]
    return result.stdout, installs


def test_pip_runs_once_until_pyproject_or_the_interpreter_changes(checkout: Path) -> None:
    output, installs = setup(checkout)
    assert "a first install downloads" in output
    assert len(installs) == 1 and installs[0].endswith('-e .[models,client]')
    assert "--progress-bar on" in installs[0] and "--quiet" not in installs[0]
    output, installs = setup(checkout)
    assert installs == [] and "pip skipped" in output
    with (checkout / "pyproject.toml").open("a") as pyproject:
        pyproject.write("\n# a new line\n")
    assert len(setup(checkout)[1]) == 1
    assert setup(checkout)[1] == []
    assert len(setup(checkout, FAKE_PYTHON_VERSION="Python 3.12.1")[1]) == 1


def test_extras_already_installed_skip_pip_and_new_ones_run_it(checkout: Path) -> None:
    assert setup(checkout, "dev")[1][0].endswith("-e .[models,client,dev]")
    assert setup(checkout)[1] == []  # serve.sh after a set-up with more
    output, installs = setup(checkout, "ray")
    assert installs[0].endswith("-e .[models,client,ray]")
    assert "installing the extras [ray]" in output
    assert setup(checkout, "dev", "ray")[1] == []  # test.sh's: both recorded


def test_a_failed_install_is_tried_again(checkout: Path) -> None:
    result = subprocess.run(["bash", "scripts/setup.sh"], cwd=checkout, capture_output=True,
                            text=True, timeout=60, env={**os.environ, "FAKE_PIP_STATUS": "1"})
    assert result.returncode == 1
    assert not (checkout / ".venv" / ".setup-stamp").exists()
    assert len(setup(checkout)[1]) == 1
