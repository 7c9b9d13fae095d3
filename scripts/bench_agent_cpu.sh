#!/usr/bin/env bash
# Real-engine comparison over HTTP on this machine: a model with a small KV pool, fcfs against
# continuum, at two loads. Usage: scripts/bench_agent_cpu.sh [OUT_DIR] [MODEL]
# MODEL is `tiny` (the default) or another `--model` value such as smollm2-135m-instruct;
# result files of a model other than tiny carry its name.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench-results}
model=${2:-tiny}
suffix=""
if [ "$model" != tiny ]; then
  suffix="_$(basename "$model")"
fi
mkdir -p "$out"
port=8391
for policy in fcfs continuum; do
  .venv/bin/continuum serve --port "$port" --model "$model" --scheduling-policy "$policy" \
    --num-kv-blocks 96 --max-model-len 1024 --log-level warning &
  server=$!
  trap 'kill $server 2>/dev/null || true' EXIT
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do sleep 0.5; done
  for load in 1 4; do
    .venv/bin/continuum bench agent --base-url "http://127.0.0.1:$port" \
      --trace tests/data/minisweagent_deepseek_slice.jsonl --token-scale 0.05 \
      --jobs-per-s "$load" --label "$policy" --no-progress \
      --json "$out/agent_${policy}_${load}${suffix}.json"
  done
  kill "$server"; wait "$server" 2>/dev/null || true
done
