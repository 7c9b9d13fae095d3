#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) the wheels that the GPU machine's image lacks, for Python
# 3.12 on manylinux x86_64 (glibc up to 2.35; the image's Python 3.12.3 is Ubuntu 24.04's, glibc
# 2.39), at the versions installed in this checkout's .venv (the ones the
# test suite passes with). The engine imports msgspec, llguidance and pyzmq for every command
# (`python -m lab forward` and `bench throughput` included); `serve` and `bench agent` need the rest.
#
# Usage, here (network needed): bash eval/gpu/fetch_wheels.sh
# Then on the GPU machine (the device tool's `run`, with ".whl" in `carry`):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# (scripts/gpu_bench.sh does this itself when .whl/ is there and msgspec is missing).
set -euo pipefail
cd "$(dirname "$0")/../.."

# Distributions missing from the image (/work/.library/device/KINDS.md lists what it has), with
# those of their requirements whose image versions are too old or absent.
names=(
  msgspec llguidance pyzmq
  fastapi starlette uvicorn h11 pydantic pydantic-core annotated-types typing-inspection
  typing-extensions opentelemetry-api anyio idna
  openai jiter sniffio httpx2 httpcore2 truststore
)
python=${PYTHON:-.venv/bin/python}
pins=$("$python" - "${names[@]}" <<'EOF'
import importlib.metadata as metadata
import sys

print(" ".join(f"{name}=={metadata.version(name)}" for name in sys.argv[1:]))
EOF
)
rm -rf .whl
# shellcheck disable=SC2086  # one argument per pin
"$python" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform manylinux_2_31_x86_64 \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 -d .whl $pins
du -sh .whl
