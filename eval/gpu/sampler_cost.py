"""What sampling costs a step on this machine, by kind of sampling.

Two measurements:
- `model`: the real SmolLM2-135M-Instruct (fetched by `scripts/setup.sh`) answers 16 chat
  requests of 64 tokens each (`ignore_eos`) through `LLM.chat`, in one batch, under each
  kind of sampling; printed are the sampler's mean milliseconds a step (`Sampler.__call__`
  timed around each call) and the run's wall time. A real model's nucleus is what decides
  how far the top-p search goes: a few tokens at temperature 0.7, thousands at 1.3.
- `filter`: `apply_top_k_top_p` alone on 32 rows of random logits over SmolLM2's 49,152
  tokens, scaled from flat (0.1) to peaked (8), median milliseconds of 10 calls, for a
  top-p alone, a top-k of 2,000 with it (no bound given: each row searched for itself) and
  the GPU's sort of every row, run here.

Usage: python eval/gpu/sampler_cost.py [--part model|filter ...]
(`python - --part model < eval/gpu/sampler_cost.py` from another worktree measures that one's
engine: run as a file, the script imports the installed checkout's.)
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.frontend.llm import LLM
from engine.sample import sampler as sampler_module
from engine.sample.top_k_top_p import apply_top_k_top_p
from engine.sampling_params import SamplingParams

SAMPLINGS: list[tuple[str, dict[str, Any]]] = [
    ("greedy", {"temperature": 0.0}),
    ("temperature 1", {"temperature": 1.0}),
    ("temperature 0.7, top-p 0.9", {"temperature": 0.7, "top_p": 0.9}),
    ("temperature 1, top-p 0.95", {"temperature": 1.0, "top_p": 0.95}),
    ("temperature 1.3, top-p 0.95", {"temperature": 1.3, "top_p": 0.95}),
    ("temperature 0.8, top-k 50, top-p 0.95", {"temperature": 0.8, "top_k": 50, "top_p": 0.95}),
]
TOPICS = ["the ocean", "a city at night", "old trains", "mountains", "coffee", "a library",
          "winter", "robots", "a garden", "the moon", "rivers", "music", "bread", "bicycles",
          "clouds", "markets"]


def model_part() -> None:
    sampler_s: list[float] = []
    call = sampler_module.Sampler.__call__

    def timed(self: sampler_module.Sampler, *args: Any) -> Any:
        started_s = time.perf_counter()
        try:
            return call(self, *args)
        finally:
            sampler_s.append(time.perf_counter() - started_s)

    sampler_module.Sampler.__call__ = timed  # type: ignore[method-assign]
    llm = LLM("smollm2-135m-instruct", max_num_seqs=len(TOPICS))
    conversations = [[{"role": "user", "content": f"Write a short story about {topic}."}]
                     for topic in TOPICS]
    print("| sampling | sampler (ms a step) | wall (s) |\n|---|---:|---:|")
    try:
        for name, kwargs in SAMPLINGS:
            params = SamplingParams(max_tokens=64, ignore_eos=True, **kwargs)
            llm.chat(conversations[:2], params, use_tqdm=False)  # warm-up
            sampler_s.clear()
            started_s = time.perf_counter()
            llm.chat(conversations, params, use_tqdm=False)
            wall_s = time.perf_counter() - started_s
            print(f"| {name} | {1000 * statistics.mean(sampler_s):.1f} | {wall_s:.2f} |")
    finally:
        llm.shutdown()


def filter_part() -> None:
    generator = torch.Generator().manual_seed(0)
    print("| logits' scale | top-p 0.95 (ms) | top-k 2,000, top-p 0.95 (ms) | sort (ms) |\n"
          "|---:|---:|---:|---:|")
    for scale in (0.1, 0.5, 3.0, 8.0):
        logits = torch.randn(32, 49152, generator=generator) * scale
        top_p, top_k = torch.full((32,), 0.95), torch.full((32,), 2000)
        timings = [_median_ms(functools.partial(apply_top_k_top_p, logits, k, top_p, None, search))
                   for k, search in ((None, "binned"), (top_k, "binned"), (None, "sort"))]
        print(f"| {scale} | " + " | ".join(f"{ms:.1f}" for ms in timings) + " |")


def _median_ms(function: Callable[[], object], repeats: int = 10) -> float:
    function()
    times = []
    for _ in range(repeats):
        started_s = time.perf_counter()
        function()
        times.append(time.perf_counter() - started_s)
    return 1000 * statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", action="append", choices=["model", "filter"])
    args = parser.parse_args()
    parts = args.part or ["model", "filter"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if "model" in parts:
        model_part()
    if "filter" in parts:
        filter_part()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
