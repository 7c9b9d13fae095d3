"""Hugging Face `config.json` files of models the engine is benchmarked at, without weights.

Run with random weights: `python -m lab forward --config FILE`, or as a model directory
holding the file as `config.json` with `--load-format dummy --tokenizer tiny`.
- `llama3.1-8b.json`: Llama-3.1-8B's published shapes (the GPU benchmark, `scripts/gpu_bench.sh`).
- `llama3.1-70b.json`: Llama-3.1-70B's published shapes, served on one GPU with FP8
  projections (`--quantization fp8`: 73 GB of weights, 141 GB in bfloat16); its CPU stand-in
  for tests and dry runs is `eval/gpu/llama3.1-70b-shrunk.json`.
- `qwen2.5-0.5b.json`: Qwen2.5-0.5B's shapes (a CPU benchmark).
- `smollm2-135m-instruct.json`: the catalogued real model's shapes (3 query heads per KV head,
  head dim 64), for the GPU benchmark's forward step, where the model cannot be fetched.
"""

from pathlib import Path

CONFIGS_DIR = Path(__file__).resolve().parent
