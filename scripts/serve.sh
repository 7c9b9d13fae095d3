#!/usr/bin/env bash
# Sets up .venv and the real model (see setup.sh) and starts the OpenAI-compatible server on
# http://127.0.0.1:8000, serving `smollm2-135m-instruct` (or the random `tiny` model when the
# set-up could not fetch it). Arguments go to `continuum serve`; `--model NAME` picks another.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
for arg in "$@"; do
    case $arg in
        --model|--model=*) exec .venv/bin/continuum serve "$@" ;;
    esac
done
model=smollm2-135m-instruct
if ! .venv/bin/continuum models path "$model" >/dev/null 2>&1; then
    echo "serve: $model is not in the model cache; serving the random 'tiny' model" >&2
    model=tiny
fi
exec .venv/bin/continuum serve --model "$model" "$@"
