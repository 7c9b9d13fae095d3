#!/usr/bin/env bash
# Sets up .venv (see setup.sh) with the dev tools and Ray Serve and runs the linter and the test
# suite on two pytest-xdist workers, each test file on one worker (its module fixtures, such as
# a server or a Ray cluster, start once).
# Extra arguments go to pytest (`-n 0` runs the tests in one process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev ray
.venv/bin/ruff check .
.venv/bin/python -m pytest -n 2 --dist loadfile "$@"
