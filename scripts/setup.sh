#!/usr/bin/env bash
# Creates .venv (Python >= 3.10) and installs torch 2.13.0 (CPU build) and the package into it.
# Extra arguments name optional dependency groups, for example `bash scripts/setup.sh dev`.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
extras=""
if [ "$#" -gt 0 ]; then
    extras="[$(IFS=,; echo "$*")]"
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0" -e ".${extras}"
