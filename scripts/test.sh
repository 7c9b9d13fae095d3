#!/usr/bin/env bash
# Sets up .venv (see setup.sh) with the dev tools and Ray Serve and runs the linter and the test
# suite.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev ray
.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"
