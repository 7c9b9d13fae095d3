#!/usr/bin/env bash
# Sets up .venv (Python >= 3.10, torch 2.13.0 CPU build, the package and its dev tools) and
# runs the linter and the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0" -e ".[dev]"
.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"
