#!/usr/bin/env bash
# Sets up .venv (see setup.sh) and starts the OpenAI-compatible server. With no arguments it
# serves the embedded `tiny` model on http://127.0.0.1:8000; arguments go to `continuum serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/continuum serve "$@"
