#!/usr/bin/env bash
# The GPU benchmark of issue 35 in one command: Llama-3.1-8B's shapes (random weights, bf16,
# engine/model/configs/llama3.1-8b.json, the tokenizer of `tiny`) through the engine.
#   smoke       (only when asked for: --part smoke) the CUDA tests (the Triton kernels against
#               the sdpa reference on the device, float32/bf16 parity with transformers, the
#               loader, the layer kernels, fp8 projections, async scheduling against steps in
#               order on the device, steps launched with synchronizing CUDA calls made
#               errors) and, unless --quick's forward part runs, one small `python -m lab forward`
#               of the 8B shapes with triton: a couple of minutes that show whether the rest
#               can run
#   kernels     (only when asked for: --part kernels) the kernels' own timings at Llama-3.1-8B's
#               shapes: eval/gpu/prefill_tiles.py (each prefill attention tile against the
#               autotuner's choice, outputs checked), eval/gpu/fp8_gemms.py (each projection
#               in bf16 and in fp8, with exact and with fast accumulation: device and host
#               time a call) and, without --quick, eval/gpu/mlp_gemms.py (the MLP's gate and
#               up projections as one GEMM or two); seconds, not minutes
#   forward     `python -m lab forward` at the issue's shapes (decode batch 1/32/128 at 1k context,
#               batch 32 at 8k, prefill 2,048 tokens; and 8 steps of 2,048 prompt tokens
#               back to back, as the engine core runs them) with the sdpa backend, torch's layer
#               ops and steps in order (the first run's code), the triton backend and fused
#               layer kernels with the defaults (async scheduling on CUDA: each decode step
#               launched before the last one's tokens are read), the same with the
#               triton-sdpa backend (triton-sdpa: SDPA attends long prompts with no cached
#               prefix), with an fp8 KV cache (triton-fp8: --kv-cache-dtype fp8), with fp8
#               projection weights (triton-fp8w: --quantization fp8), with steps in order
#               (triton-sync: --no-async-scheduling), with torch's layer ops
#               (triton-torch-layers: what the fused kernels gain) and with --enforce-eager
#               (no CUDA graphs), the triton
#               runs with --profile (launches, device and host time a decode step and a
#               prefill step, and the costliest kernels); triton on an agent's next turns,
#               chunks of 256 and 64 tokens over 30,000 cached, which split the prefill
#               kernel's keys, 4 x 256 over 8,000, which does not, and 256 over 8,000 beside
#               32 decodes at 1k (forward-extend-triton, --extend); decode batch 32 and 128
#               at 1k under each kind
#               of sampling (forward-sampling-triton, --sampling: greedy, random, nucleus,
#               seeded, penalties, grammar); on cuda also SmolLM2-135M's shapes with the
#               triton backend
#   throughput  `bench throughput --impl engine`: 256 requests, prompts 128-1,024 tokens,
#               outputs 64-512 (the first H100 run's, issue 35), with sdpa (torch's layer
#               ops, steps in order), with triton (fused layer kernels), with triton-sdpa,
#               with an fp8 KV cache (triton-fp8), with fp8 projections (triton-fp8w), with
#               both (triton-fp8-all), with steps in order (triton-sync) and with a step
#               budget of 16,384 tokens (triton-16k: vLLM's offline default on an H100); with
#               --quick
#               the sdpa run has 64 requests (step names end in the count); each reports its
#               8 slowest steps and the steps in which the CUDA caching allocator freed
#               device memory (--slow-steps 8)
#   agent       `serve` + `bench agent`: a replay of that run, fcfs and continuum, on
#               --agent-backend (default triton); not with --quick. --agent-setup swe24 (the
#               default: 24 SWE jobs of at most 6 turns at 2 jobs/s, 1,500 KV blocks, 16k
#               context) or swe40 (40 jobs of at most 8 turns at 4 jobs/s, 2,500 blocks, 32k
#               context, stopped at 222 s as that run was: jobs done by then); the servers
#               run their steps in order (--no-async-scheduling), so that their traces can
#               calibrate the simulator (`bench calibrate` refuses async traces), unless
#               --agent-async (the engine's default on CUDA)
#   70b         (only when asked for: --part 70b) Llama-3.1-70B's shapes with FP8 projections
#               (engine/model/configs/llama3.1-70b.json, --quantization fp8; the weights drawn
#               on the device in FP8): `python -m lab forward` at decode batch 1 and 32 over 1k and a
#               2,048-token prefill, also with an fp8 KV cache, and `bench throughput`'s 256
#               requests with both fp8 options
#   paper       (only when asked for: --part paper) the paper's comparison: SWE and BFCL jobs of
#               the shipped workloads replayed at three loads under fcfs, continuum-fixed and
#               continuum, on Llama-3.1-8B (bf16) and Llama-3.1-70B (FP8 projections and KV
#               cache), one fresh server a run (eval/gpu/paper_setups.py holds the runs; its
#               `estimate` prices them and packs them into device calls; --paper-models,
#               --paper-workloads and --paper-loads choose a call's share); steps in order
#               (--no-async-scheduling, unless --agent-async), each run's trace kept; then
#               eval/gpu/paper_report.py (the comparison's targets and the JCT-against-load
#               figure, into OUT_DIR/paper.md, paper.json, paper-jct.png), `bench calibrate`
#               on the 8B runs but those of the middle load, and `python -m lab check-calibration` of
#               that profile against the held-out runs (their manifest written by
#               paper_setups.py); with --dry-run, that analysis runs here on a stand-in of
#               the runs' files, simulated (`paper_setups.py stand-in`)
# Each step's JSON and log go to OUT_DIR/raw; OUT_DIR/summary.md (markdown tables naming the
# device, torch and triton) and OUT_DIR/results.json merge them, also when the script is
# stopped (SIGTERM, or the device tool's time limit). OUT_DIR is $OUT when set (the device
# tool's folder; raw/ is then packed into raw.tar.gz, as only 8 files come back), else
# gpu-bench-out/. A failing step is recorded and the others still run; a step that would start
# past --budget-s is skipped (recorded, exit 125), one still running at it is stopped (exit 124).
# The exit code is 1 if any step failed or was skipped.
#
# Usage: bash scripts/gpu_bench.sh [--quick] [--device cuda|cpu] [--part smoke|kernels|forward|
#        throughput|agent|70b|paper ...] [--budget-s S] [--agent-setup swe24|swe40]
#        [--agent-backend sdpa|triton|triton-sdpa|auto (default: triton on cuda, sdpa on cpu)]
#        [--agent-async] [--paper-models 8b,70b] [--paper-workloads swe,bfcl]
#        [--paper-loads 1,2,3] [--engine-commit SHA] [--baseline DIR] [--dry-run]
#   --quick    forward + throughput (triton's 256 requests, sdpa's 64), no agent replay, the
#              triton runs first (the targets' runs, the same with triton-sdpa, an agent's
#              next turns, fp8 projections, both fp8 options, the sampling kinds, an fp8 KV
#              cache, steps in order, the 16k step budget, then triton with torch's layer
#              ops, the sdpa baselines,
#              triton without graphs and SmolLM2),
#              within --budget-s 540 unless given: one device call's 10 minutes
#   --part     run only these parts (repeatable); the full run takes more than one device call's
#              10 minutes, so there run `--part forward --part throughput`, then `--part agent`;
#              a first call on a new GPU is best `--part smoke` (a couple of minutes)
#   --budget-s no step starts, and a running one is stopped, this many seconds after the
#              script started (default: none; 540 with --quick)
#   --paper-models, --paper-workloads, --paper-loads  the paper part's runs: comma-separated
#              models (8b, 70b), workloads (swe, bfcl) and loads (1, 2, 3: each setup's
#              lowest to highest; a setup runs its highest first) (default: all)
#   --engine-commit SHA  the commit the calibrated profile names (default: git's HEAD, where
#              the checkout has git; the device tool's copy has none)
#   --device cpu  a dry run of the same steps on this CPU machine with the tiny model and tiny
#              shapes (triton under TRITON_INTERPRET=1), in a couple of minutes
#   --baseline DIR  another checkout of the repository (say `git archive COMMIT engine eval
#              scripts tracing estimator continuum pyproject.toml | tar -x -C .baseline`,
#              carried as an ignored folder; checked before any step: its `bench` must import;
#              a relative DIR is taken from the repository's root): the prefill tile
#              timings, the forward run `triton` and the offline run `triton` also run from
#              it, each right after this checkout's (steps named `...-base`), so that two
#              engines are compared on one device; they spend the same --budget-s
#   --dry-run  print each step's command (`== dry run NAME: COMMAND`, shell-quoted) instead of
#              running it, and record it as passed: what a device call would run, in seconds
#              (tests/scripts/test_gpu_bench_dry_run.py parses every engine command of it)
#
# On the GPU machine (the device tool): its image has torch and triton but not msgspec,
# llguidance, pyzmq (which every engine command imports) nor fastapi, uvicorn, pydantic, openai
# (serve, bench agent). Fetch their wheels here once with `bash eval/gpu/fetch_wheels.sh`
# (into .whl/, git-ignored), then call the tool's `run` with carry [".whl"] and
#   command: PYTHONUNBUFFERED=1 bash scripts/gpu_bench.sh --quick
# This script installs .whl/*.whl with `pip install --no-index --no-deps --target` into a
# temporary folder and puts it on PYTHONPATH when msgspec is missing. It runs the engine as
# `python -m engine.cli` from this checkout (no install needed); PYTHON picks the interpreter
# (default: .venv/bin/python if there, else python3).
set -uo pipefail
cd "$(dirname "$0")/.."

quick=0
device=cuda
agent_backend=""
agent_setup=swe24
agent_serve=(--no-async-scheduling)  # the serve flag --agent-async sets
baseline=""
budget_s=""
dry_run=0
parts=()
paper_models=8b,70b
paper_workloads=swe,bfcl
paper_loads=1,2,3
engine_commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
while [ $# -gt 0 ]; do
  case $1 in
    --quick) quick=1 ;;
    --device) device=$2; shift ;;
    --part) parts+=("$2"); shift ;;
    --budget-s) budget_s=$2; shift ;;
    --agent-backend) agent_backend=$2; shift ;;
    --agent-setup) agent_setup=$2; shift ;;
    --agent-async) agent_serve[0]=--async-scheduling ;;
    --paper-models) paper_models=$2; shift ;;
    --paper-workloads) paper_workloads=$2; shift ;;
    --paper-loads) paper_loads=$2; shift ;;
    --engine-commit) engine_commit=$2; shift ;;
    --baseline) baseline=$(cd -- "$2" > /dev/null && pwd -P) || exit 2; shift ;;
    --dry-run) dry_run=1 ;;
    -h|--help) sed -n '2,/^set /p' "$0" | sed '$d'; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [ ${#parts[@]} -eq 0 ]; then
  parts=(forward throughput)
  [ $quick -eq 1 ] || parts+=(agent)
fi
for part in "${parts[@]}"; do
  case $part in
    smoke|kernels|forward|throughput|agent|70b|paper) ;;
    *) echo "--part must be smoke, kernels, forward, throughput, agent, 70b or paper, got" \
            "$part" >&2
       exit 2 ;;
  esac
done
wants() { [[ " ${parts[*]} " == *" $1 "* ]]; }
case $agent_setup in
  swe24|swe40) ;;
  *) echo "--agent-setup must be swe24 or swe40, got $agent_setup" >&2; exit 2 ;;
esac
[ $quick -eq 1 ] && budget_s=${budget_s:-540}
if [ -n "$budget_s" ] && ! [[ $budget_s =~ ^[0-9]+$ ]]; then
  echo "--budget-s must be a whole number of seconds, got $budget_s" >&2
  exit 2
fi

python=${PYTHON:-}
if [ -z "$python" ]; then
  if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
# Absolute when it is a path: baseline steps run from another directory.
[[ $python != */* || $python == /* ]] || python=$PWD/$python
if [ -d .whl ] && ! "$python" -c "import msgspec" 2>/dev/null; then
  site=$(mktemp -d)/site
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl || exit 1
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
fi
paper_runs=""
if wants paper; then
  paper_runs=$("$python" eval/gpu/paper_setups.py runs --device "$device" \
    --models "$paper_models" --workloads "$paper_workloads" --loads "$paper_loads") || exit 2
fi
# Every engine command imports these; serve and bench agent need the HTTP stack too.
needed="msgspec, zmq, llguidance"
{ wants agent || wants paper; } && needed="$needed, fastapi, uvicorn, pydantic, openai"
if ! "$python" -c "import $needed" 2>/dev/null; then
  echo "missing Python packages (need $needed): run eval/gpu/fetch_wheels.sh here and" \
       "carry .whl to the GPU machine (see the top of this script)" >&2
  exit 2
fi

# The baseline's benches must import, each of the project's modules from the baseline itself
# (not from an install of this checkout): a package missing from its archive fails here.
if [ -n "$baseline" ] && ! env -C "$baseline" "PYTHONPATH=$baseline${PYTHONPATH:+:$PYTHONPATH}" \
    "$python" - "$baseline" <<'EOF'; then
import os
import sys

import importlib.util

import eval.bench.throughput  # noqa: F401

# A baseline from before the lab left the wheel has its forward bench in eval.
if importlib.util.find_spec("lab") is not None:
    import lab.bench.forward  # noqa: F401
else:
    import eval.bench.forward  # noqa: F401

ours = ("engine", "eval", "tracing", "estimator", "continuum", "lab")
root = os.path.realpath(sys.argv[1]) + os.sep
elsewhere = sorted(name for name, module in list(sys.modules.items())
                   if name.split(".")[0] in ours and getattr(module, "__file__", None)
                   and not os.path.realpath(module.__file__).startswith(root))
if elsewhere:
    sys.exit(f"imported from outside the baseline: {', '.join(elsewhere[:8])}")
EOF
  echo "--baseline $baseline: its benches do not import from it alone (a package missing" \
       "from the archive?); see --help" >&2
  exit 2
fi

out=${OUT:-gpu-bench-out}
mkdir -p "$out"
out=$(cd "$out" && pwd)  # absolute: baseline steps run from another directory
raw=$out/raw
rm -rf "$raw"
mkdir -p "$raw"
: > "$raw/status.tsv"
scratch=$(mktemp -d)
server=""
# stop_server: the agent replay's server and its engine core (its own process group), asked
# to stop, then killed after 30 s (a server still starting up ignores SIGTERM).
stop_server() {
  [ -n "$server" ] || return 0
  kill -TERM -- "-$server" 2>/dev/null
  for _ in $(seq 30); do
    kill -0 "$server" 2>/dev/null || break
    sleep 1
  done
  kill -KILL -- "-$server" 2>/dev/null
  wait "$server" 2>/dev/null
  server=""
}
# report: the summary of the steps that ran, and raw/ packed when the device tool's $OUT is the
# output (only its 8 files come back). Also on SIGTERM, so that a stopped run keeps its results.
reported=0
report() {
  [ $reported -eq 0 ] || return 0
  reported=1
  PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$python" eval/gpu/bench_report.py "$raw" "$out"
  if [ -n "${OUT:-}" ]; then
    tar czf "$out/raw.tar.gz" -C "$out" raw && rm -rf "$raw"
  fi
}
trap 'stop_server; rm -rf "$scratch"' EXIT
step_pid=""
stopped() {
  echo "== stopped: reporting what ran"
  [ -z "$step_pid" ] || kill -TERM "$step_pid" 2>/dev/null
  stop_server
  report
  exit 143
}
trap stopped TERM INT

if [ "$device" = cuda ]; then
  config=$PWD/engine/model/configs/llama3.1-8b.json
  model_name=llama3.1-8b
  forward_shapes=()  # bench forward's defaults: the issue's table, and 2k prefills back to back
  # An agent's next turns: chunks over long cached contexts, the first two split the prefill
  # kernel's keys (3 and 9 splits), the third (512 programs) is the unsplit control; the
  # last arrives beside 32 decodes at 1k, as in a serving step.
  extend_shapes=(--extend 1x256@30000 1x64@30000 4x256@8000 1x256@8000+32x1024)
  sampling_shapes=(--decode 32x1024 128x1024 --prefill)
  smoke_shapes=(--decode 4x1024 --prefill 1x2048 --decode-steps 4 --repeats 1)
  # The target's run is 256 requests; --quick gives the sdpa baseline 64 (it takes 5x longer).
  target_requests=256
  baseline_requests=256
  [ $quick -eq 1 ] && baseline_requests=64
  workload=(--prompt-len 128 1024 --output-len 64 512 --max-model-len 4096)
  if [ "$agent_setup" = swe24 ]; then
    serve_flags=(--num-kv-blocks 1500 --max-model-len 16384)
    agent_flags=(--num-jobs 24 --jobs-per-s 2 --max-turns 6 --vocab-size 250)
  else
    serve_flags=(--num-kv-blocks 2500 --max-model-len 32768)
    agent_flags=(--num-jobs 40 --jobs-per-s 4 --max-turns 8 --vocab-size 250
                 --stop-after-s 222)
  fi
  agent_backend=${agent_backend:-triton}
elif [ "$device" = cpu ]; then
  config=$PWD/engine/model/tiny/config.json
  model_name=tiny
  export TRITON_INTERPRET=1  # the triton backend's kernels run on CPU tensors
  forward_shapes=(--decode 2x48 4x96 --prefill 1x64 --decode-steps 2 --repeats 1
                  --max-num-batched-tokens 64)
  extend_shapes=(--extend 1x4@60 1x4@40+2x16 --repeats 1 --max-num-batched-tokens 64)
  sampling_shapes=(--decode 2x48 --prefill --decode-steps 2 --repeats 1
                   --max-num-batched-tokens 64)
  smoke_shapes=("${forward_shapes[@]}")
  target_requests=4
  baseline_requests=4
  workload=(--prompt-len 8 32 --output-len 2 8 --max-model-len 256)
  serve_flags=(--num-kv-blocks 256 --max-model-len 2048)
  agent_flags=(--num-jobs 2 --jobs-per-s 2 --max-turns 2 --token-scale 0.02 --vocab-size 250)
  [ "$agent_setup" = swe40 ] && agent_flags+=(--num-jobs 3 --stop-after-s 20)
  # The continuum policy profiles prefills up to --max-model-len at startup: minutes under
  # the Triton interpreter.
  agent_backend=${agent_backend:-sdpa}
else
  echo "--device must be cuda or cpu, got $device" >&2
  exit 2
fi
model_dir=$scratch/$model_name
mkdir -p "$model_dir"
cp "$config" "$model_dir/config.json"
engine_flags=(--model "$model_dir" --load-format dummy --tokenizer "$PWD/engine/model/tiny"
              --device "$device")

"$python" - "$config" "$device" \
  "$([ $quick -eq 1 ] && echo quick || echo full)$([ $dry_run -eq 0 ] || echo ', dry run')" \
  > "$raw/environment.json" <<'EOF'
import json
import sys
from importlib import metadata

import torch

config, device, mode = sys.argv[1:]
try:
    triton = metadata.version("triton")
except metadata.PackageNotFoundError:
    triton = "not installed"
if torch.cuda.is_available():
    name = torch.cuda.get_device_name()
else:
    name = "cpu" if device == "cpu" else "no CUDA device"
print(json.dumps({"device": name, "torch": torch.__version__, "triton": triton,
                  "config": config, "mode": mode}))
EOF

# dry_run_print NAME COMMAND...: what --dry-run prints instead of running a command.
dry_run_print() {
  printf '== dry run %s:' "$1"
  shift
  printf ' %q' "$@"
  echo
}

# step NAME COMMAND...: runs it with its output in raw/NAME.log; records exit code and seconds.
# With --budget-s, a step is skipped (exit 125) once the budget is spent, and stopped (exit
# 124) when it runs past it.
step() {
  local name=$1 started=$SECONDS code
  shift
  if [ $dry_run -eq 1 ]; then
    # A shell function (the agent replay) prints its own commands.
    if declare -F "$1" > /dev/null; then "$@"; else dry_run_print "$name" "$@"; fi
    printf '%s\t0\t0\n' "$name" >> "$raw/status.tsv"
    return
  fi
  local limit=()
  if [ -n "$budget_s" ]; then
    local left=$((budget_s - SECONDS))
    if [ "$left" -le 5 ]; then
      printf '%s\t125\t0\n' "$name" >> "$raw/status.tsv"
      echo "== $name SKIPPED (the --budget-s of $budget_s s is spent)"
      return
    fi
    # `timeout` runs programs; a shell function (the agent replay) only gets skipped.
    declare -F "$1" > /dev/null || limit=(timeout --kill-after 10 "$left")
  fi
  echo "== $name: $*"
  # In the background, so that a SIGTERM to this script is handled at once (bash runs traps
  # only between foreground commands).
  "${limit[@]}" "$@" > "$raw/$name.log" 2>&1 &
  step_pid=$!
  wait "$step_pid"
  code=$?
  step_pid=""
  printf '%s\t%s\t%s\n' "$name" "$code" "$((SECONDS - started))" >> "$raw/status.tsv"
  tail -n 12 "$raw/$name.log"
  [ "$code" -eq 0 ] || echo "== $name FAILED (exit $code)"
}

engine=("$python" -m engine.cli)
# The lab's benches (forward, check-calibration) run from the checkout; a baseline from
# before the lab left the wheel has them as `continuum bench` commands.
lab=("$python" -m lab)
base_lab=("${lab[@]}")
[ -z "$baseline" ] || [ -d "$baseline/lab" ] || base_lab=("${engine[@]}" bench)

if wants smoke; then
  tests=(tests/engine/model/attention/test_triton_kernels.py
         tests/engine/model/attention/test_triton_backend.py
         tests/engine/model/attention/test_triton_sdpa_backend.py tests/engine/model/test_parity.py
         tests/engine/model/test_loader.py tests/engine/model/test_layer_kernels.py
         tests/engine/model/test_fp8_linear.py tests/engine/core/test_async_scheduling.py
         tests/engine/worker/test_step_syncs.py)
  step smoke-tests "$python" -m pytest -x -q -p no:cacheprovider "${tests[@]}"
  # --quick's forward part runs triton's forward at full size first.
  { [ $quick -eq 1 ] && wants forward; } || step forward-smoke-triton "${lab[@]}" \
    forward --config "$config" --device "$device" --attention-backend triton \
    "${smoke_shapes[@]}" --json "$raw/forward-smoke-triton.json"
fi

# A command after these runs from the baseline checkout, its engine first on the path.
on_baseline=(env -C "$baseline" "PYTHONPATH=$baseline${PYTHONPATH:+:$PYTHONPATH}")

if wants kernels; then
  step kernels-prefill-tiles "$python" eval/gpu/prefill_tiles.py --device "$device" \
    --json "$raw/kernels-prefill-tiles.json"
  if [ -n "$baseline" ]; then
    # A baseline older than eval/gpu/ has the script in scripts/.
    base_tiles=$baseline/eval/gpu/prefill_tiles.py
    [ -f "$base_tiles" ] || base_tiles=$baseline/scripts/prefill_tiles.py
    step kernels-prefill-tiles-base "$python" "$base_tiles" --device "$device" \
      --json "$raw/kernels-prefill-tiles-base.json"
  fi
  # --quick: a decode step's rows at batch 1 and 32, and a prefill's 2,048.
  fp8_tokens=()
  [ $quick -eq 1 ] && [ "$device" = cuda ] && fp8_tokens=(--tokens 1 32 2048)
  step kernels-fp8-gemms "$python" eval/gpu/fp8_gemms.py --device "$device" "${fp8_tokens[@]}" \
    --json "$raw/kernels-fp8-gemms.json"
  # Measured on two cards already (docs/benchmarks.md, "Measured a fourth time").
  [ $quick -eq 1 ] || step kernels-mlp-gemms "$python" eval/gpu/mlp_gemms.py \
    --device "$device" --json "$raw/kernels-mlp-gemms.json"
fi

# forward_run sdpa|triton|triton-sdpa|triton-sync|triton-fp8|triton-fp8w|triton-eager|
# triton-torch-layers (async scheduling is the default on CUDA; triton-sync turns it off;
# -fp8w: fp8 projections; triton-sdpa: the backend of that name, SDPA for long fresh prompts)
forward_run() {
  local run=$1 flags=()
  case $run in
    sdpa) flags=(--attention-backend sdpa --layer-kernels torch --no-async-scheduling) ;;
    triton) flags=(--attention-backend triton --layer-kernels triton) ;;
    triton-sdpa) flags=(--attention-backend triton-sdpa --layer-kernels triton) ;;
    triton-sync) flags=(--attention-backend triton --layer-kernels triton --no-async-scheduling) ;;
    triton-fp8) flags=(--attention-backend triton --layer-kernels triton --kv-cache-dtype fp8) ;;
    triton-fp8w) flags=(--attention-backend triton --layer-kernels triton --quantization fp8) ;;
    triton-eager) flags=(--attention-backend triton --layer-kernels triton --enforce-eager) ;;
    triton-torch-layers) flags=(--attention-backend triton --layer-kernels torch) ;;
  esac
  [ "$run" = sdpa ] || flags+=(--profile)  # launches, device and host time a decode step
  local command=(forward --config "$config" --device "$device" "${flags[@]}"
                 "${forward_shapes[@]}")
  step "forward-$run" "${lab[@]}" "${command[@]}" --json "$raw/forward-$run.json"
  if [ -n "$baseline" ] && [ "$run" = triton ]; then
    step "forward-$run-base" "${on_baseline[@]}" "${base_lab[@]}" "${command[@]}" \
      --json "$raw/forward-$run-base.json"
  fi
}
forward_extend() {
  # In a run of its own: a 30,000-token context raises the runner's max_model_len, which
  # sizes the decode graphs' splits and would change the decode targets' steps.
  step forward-extend-triton "${lab[@]}" forward --config "$config" \
    --device "$device" --attention-backend triton --layer-kernels triton --decode --prefill \
    "${extend_shapes[@]}" --profile --json "$raw/forward-extend-triton.json"
}
forward_sampling() {
  # What each kind of sampling adds to a decode step: penalties and grammar masks are
  # applied on the device from inputs copied without waiting for it.
  step forward-sampling-triton "${lab[@]}" forward --config "$config" \
    --device "$device" --attention-backend triton --layer-kernels triton \
    "${sampling_shapes[@]}" --sampling greedy random nucleus seeded penalties grammar \
    --json "$raw/forward-sampling-triton.json"
}
forward_smollm2() {
  # The real model of `continuum models pull` (3 query heads per KV head, head dim 64), by
  # its shapes: the GPU machine cannot fetch it. Its 8,192 positions hold no 8k context plus
  # the timed steps, so its long shape is 8,000 tokens.
  [ "$device" = cuda ] || return 0
  step forward-smollm2-triton "${lab[@]}" forward \
    --config engine/model/configs/smollm2-135m-instruct.json --device "$device" \
    --attention-backend triton --decode 1x1024 32x1024 128x1024 32x8000 \
    --json "$raw/forward-smollm2-triton.json"
}
# throughput_run sdpa|triton|triton-sdpa|triton-sync|triton-16k|triton-fp8|triton-fp8w|
# triton-fp8-all (sdpa: torch's layers, steps in order, the first run's code; -16k:
# --max-num-batched-tokens 16384, vLLM's offline default on an H100; -fp8w: fp8 projections,
# --quantization fp8; -fp8-all: both an fp8 KV cache and fp8 projections)
throughput_run() {
  local backend=triton layers=triton requests=$target_requests kv=auto flags=()
  case $1 in
    sdpa) backend=sdpa; layers=torch; requests=$baseline_requests
          flags=(--no-async-scheduling) ;;
    triton-sdpa) backend=triton-sdpa ;;
    triton-sync) flags=(--no-async-scheduling) ;;
    triton-16k) flags=(--max-num-batched-tokens 16384) ;;
    triton-fp8) kv=fp8 ;;
    triton-fp8w) flags=(--quantization fp8) ;;
    triton-fp8-all) kv=fp8; flags=(--quantization fp8) ;;
  esac
  local command=(bench throughput --impl engine "${engine_flags[@]}" --num-requests "$requests"
                 "${workload[@]}" --attention-backend "$backend" --layer-kernels "$layers"
                 --kv-cache-dtype "$kv" --slow-steps 8 "${flags[@]}")
  step "throughput-$1-$requests" "${engine[@]}" "${command[@]}" \
    --json "$raw/throughput-$1-$requests.json"
  if [ -n "$baseline" ] && [ "$1" = triton ]; then
    step "throughput-$1-base-$requests" "${on_baseline[@]}" "${engine[@]}" "${command[@]}" \
      --json "$raw/throughput-$1-base-$requests.json"
  fi
}

if [ $quick -eq 1 ]; then
  # The targets' runs first: what a spent budget skips is the least needed.
  wants forward && forward_run triton
  wants throughput && throughput_run triton
  wants forward && forward_run triton-sdpa
  wants throughput && throughput_run triton-sdpa
  wants forward && forward_extend
  wants forward && forward_run triton-fp8w
  wants throughput && throughput_run triton-fp8-all
  wants throughput && throughput_run triton-fp8w
  wants forward && forward_sampling
  wants forward && forward_run triton-fp8
  wants throughput && throughput_run triton-fp8
  wants forward && forward_run triton-sync
  wants throughput && throughput_run triton-sync
  wants throughput && throughput_run triton-16k
  wants forward && forward_run triton-torch-layers
  wants forward && forward_run sdpa
  wants throughput && throughput_run sdpa
  wants forward && { forward_run triton-eager; forward_smollm2; }
else
  if wants forward; then
    for run in sdpa triton triton-sdpa triton-sync triton-fp8 triton-fp8w triton-torch-layers \
               triton-eager; do
      forward_run "$run"
    done
    forward_extend
    forward_sampling
    forward_smollm2
  fi
  if wants throughput; then
    for run in sdpa triton triton-sdpa triton-sync triton-16k triton-fp8 triton-fp8w \
               triton-fp8-all; do
      throughput_run "$run"
    done
  fi
fi

# Llama-3.1-70B with FP8 projections on the one card (its CPU stand-in on cpu): the forward
# shapes of its targets, with and without an fp8 KV cache, and the offline run with both.
if wants 70b; then
  if [ "$device" = cuda ]; then
    config_70b=$PWD/engine/model/configs/llama3.1-70b.json
    shapes_70b=(--decode 1x1024 32x1024 --prefill 1x2048)
  else
    config_70b=$PWD/eval/gpu/llama3.1-70b-shrunk.json
    shapes_70b=("${forward_shapes[@]}")
  fi
  for kv in auto fp8; do
    run_70b=70b-fp8w
    [ "$kv" = fp8 ] && run_70b=70b-fp8-all
    step "forward-$run_70b" "${lab[@]}" forward --config "$config_70b" \
      --device "$device" --attention-backend triton --quantization fp8 --kv-cache-dtype "$kv" \
      "${shapes_70b[@]}" --json "$raw/forward-$run_70b.json"
  done
  model_dir_70b=$scratch/$(basename "$config_70b" .json)
  mkdir -p "$model_dir_70b"
  cp "$config_70b" "$model_dir_70b/config.json"
  step "throughput-70b-fp8-all-$target_requests" "${engine[@]}" bench throughput --impl engine \
    --model "$model_dir_70b" --load-format dummy --tokenizer "$PWD/engine/model/tiny" \
    --device "$device" --num-requests "$target_requests" "${workload[@]}" \
    --attention-backend triton --kv-cache-dtype fp8 --quantization fp8 --slow-steps 8 \
    --json "$raw/throughput-70b-fp8-all-$target_requests.json"
fi

# serve_and_replay NAME: the server `replay_serve` (a command, less its --port and
# --trace-path) on a free port, then the replay `replay_client` (less --base-url and --json)
# against it, then the server stopped: the replay's report is raw/NAME.json, the server's trace
# raw/NAME.trace.jsonl.gz. Within --budget-s, the wait for the server and the replay end at the
# budget (the replay's exit 124: stopped).
serve_and_replay() {
  local name=$1 port limit=()
  port=$("$python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); \
print(s.getsockname()[1])")
  local serve=("${replay_serve[@]}" --port "$port" --trace-path "$raw/$name.trace.jsonl")
  local replay=("${replay_client[@]}" --base-url "http://127.0.0.1:$port"
                --json "$raw/$name.json")
  if [ $dry_run -eq 1 ]; then
    dry_run_print "$name-serve" "${serve[@]}"
    dry_run_print "$name" "${replay[@]}"
    return 0
  fi
  # This runs as a step in the background: stopped, it stops its server first.
  trap 'stop_server; exit 143' TERM
  # In a session of its own, so that stop_server reaches the engine core too.
  setsid "${serve[@]}" &
  server=$!
  local wait_s=900
  [ -z "$budget_s" ] || wait_s=$((budget_s - SECONDS))
  "$python" - "$port" "$server" "$wait_s" <<'EOF'
import os
import sys
import time
import urllib.request

port, server, wait_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
# Loading and capturing graphs for 8B takes minutes at worst; no later than the budget.
deadline = time.monotonic() + min(900.0, wait_s)
while time.monotonic() < deadline:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
        sys.exit(0)
    except OSError:
        os.kill(server, 0)  # raises if the server died
        time.sleep(1)
sys.exit("the server did not become healthy")
EOF
  local code=$?
  if [ $code -eq 0 ]; then
    [ -z "$budget_s" ] || limit=(timeout --kill-after 10 "$((budget_s - SECONDS))")
    "${limit[@]}" "${replay[@]}"
    code=$?
  fi
  stop_server
  local trace=$raw/$name.trace.jsonl
  [ -f "$trace" ] && gzip -f "$trace"
  return $code
}

# agent_replay POLICY: a server on the policy, the swe replay against it, the server stopped.
agent_replay() {
  local policy=$1
  replay_serve=("$python" -m engine.cli serve "${engine_flags[@]}" "${serve_flags[@]}"
                --attention-backend "$agent_backend" --scheduling-policy "$policy"
                "${agent_serve[@]}" --log-level warning)
  replay_client=("${engine[@]}" bench agent --workload swe "${agent_flags[@]}" --label "$policy"
                 --no-progress)
  serve_and_replay "agent-$agent_setup-$policy"
}

if wants agent; then
  for policy in fcfs continuum; do
    step "agent-$agent_setup-$policy" agent_replay "$policy"
  done
fi

# paper_replay NAME POLICY CONFIG SERVE_WORDS CLIENT_WORDS: one run of
# eval/gpu/paper_setups.py (its flags as shell-quoted words), on a model directory holding
# CONFIG as its config.json, named after CONFIG (a config.json: after its folder).
paper_replay() {
  local name=$1 policy=$2 config=$3 serve_extra client_extra model_dir
  eval "serve_extra=($4)"
  eval "client_extra=($5)"
  model_dir=$scratch/$(basename "$config" .json)
  [ "$(basename "$config")" != config.json ] || \
    model_dir=$scratch/$(basename "$(dirname "$config")")
  mkdir -p "$model_dir"
  cp "$config" "$model_dir/config.json"
  replay_serve=("$python" -m engine.cli serve --model "$model_dir" --load-format dummy
                --tokenizer "$PWD/engine/model/tiny" --device "$device" "${serve_extra[@]}"
                --attention-backend "$agent_backend" "${agent_serve[@]}" --log-level warning)
  replay_client=("${engine[@]}" bench agent "${client_extra[@]}" --label "$policy"
                 --no-progress)
  serve_and_replay "$name"
}

# paper_step NAME COMMAND...: a step of the paper part's analysis. A dry run prints it, then
# runs it on the stand-in of the device's files (the runs simulated), so that the report, the
# targets and the calibration are checked end to end without a device.
paper_step() {
  if [ $dry_run -eq 0 ]; then
    step "$@"
    return
  fi
  dry_run_print "$@"
  dry_run=0
  step "$@"
  dry_run=1
}

if wants paper; then
  # The replays' reports and traces; in a dry run, the stand-in's.
  paper_dir=$raw
  [ $dry_run -eq 0 ] || paper_dir=$raw/paper-stand-in
  fit_traces=()
  check_traces=()
  while IFS=$'\t' read -r -u 3 name model _ load policy config serve_words client_words; do
    step "$name" paper_replay "$name" "$policy" "$config" "$serve_words" "$client_words"
    trace=$paper_dir/$name.trace.jsonl.gz
    # The 8B's traces calibrate the simulator, the middle load's held out.
    if [ "$model" = 8b ] && { [ $dry_run -eq 1 ] || [ -f "$trace" ]; }; then
      if [ "$load" = 2 ]; then check_traces+=("$trace"); else fit_traces+=("$trace"); fi
    fi
  done 3<<< "$paper_runs"
  if [ $dry_run -eq 1 ]; then
    dry_run=0
    step paper-stand-in "$python" eval/gpu/paper_setups.py stand-in "$paper_dir" \
      --models "$paper_models" --workloads "$paper_workloads" --loads "$paper_loads"
    dry_run=1
  fi
  paper_step paper-report "$python" eval/gpu/paper_report.py "$paper_dir" --out "$out"
  card=$("$python" -c "import json, sys
name = json.load(open(sys.argv[1]))['device'].lower()
print(next((card for card in ('h200', 'h100', 'cpu') if card in name), 'gpu'))" \
    "$raw/environment.json")
  # The first steps of a trace launch kernels for the first time (the command drops 20 by
  # default); the CPU's runs are a few steps each, the stand-in's simulated.
  warmup_steps=20
  { [ "$device" = cpu ] || [ $dry_run -eq 1 ]; } && warmup_steps=0
  if [ ${#fit_traces[@]} -gt 0 ]; then
    # The roofline base profile gives the 8B's shape; the step costs are the fit's.
    paper_step paper-calibrate "${engine[@]}" bench calibrate --trace "${fit_traces[@]}" \
      ${check_traces[@]:+--check "${check_traces[@]}"} --base-profile h100-llama3.1-8b \
      --name "$card-llama3.1-8b-$engine_commit" --engine-commit "$engine_commit" \
      --warmup-steps "$warmup_steps" --out "$raw/paper-profile.json"
  fi
  # Held-out runs, and a profile fitted (in a dry run, it is fitted on the stand-in).
  if [ ${#check_traces[@]} -gt 0 ] && { [ $dry_run -eq 1 ] || [ -f "$raw/paper-profile.json" ]; }
  then
    paper_step paper-check-manifest "$python" eval/gpu/paper_setups.py manifest "$paper_dir" \
      --device "$([ $dry_run -eq 1 ] && echo cuda || echo "$device")" \
      --profile paper-profile --out "$raw/paper-check.json"
    # check-calibration names the runs' files relative to the manifest's folder.
    paper_step paper-check-calibration "${lab[@]}" check-calibration \
      --manifest "$raw/paper-check.json" --runs-dir "$paper_dir" \
      --profile "$raw/paper-profile.json" --json "$raw/paper-check-calibration.json"
  fi
fi

failed=$(awk -F'\t' '$2 != 0 { failed = 1 } END { print failed + 0 }' "$raw/status.tsv")
report
exit "$failed"
