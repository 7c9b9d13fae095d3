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
- `device` (not by default; CUDA, or `--device cpu` under the interpreter as a dry run):
  `apply_top_k_top_p` on the device, the sort of every row (`sort`, CUDA's search) against
  the radix select (`radix`) with each digit width, on 1 to 256 rows of random logits over
  Llama-3's 128,256 tokens, flat (scale 1, as random weights give) and peaked (scale 8), for
  a top-p of 0.9 alone and with a top-k of 50 on half the rows; the mean milliseconds of 20
  calls (median of 5 such runs), and the rows and tokens the radix select keeps otherwise
  than the sort (roundings may move a cut by the token at its crossing). `RADIX_ON_CUDA`
  and `DIGIT_BITS` in `engine/sample/` follow what it finds; `--json` writes the rows.

Usage: python scripts/sampler_cost.py [--part model|filter|device ...] [--device cuda|cpu]
       [--vocab-size N] [--rows N ...] [--calls N] [--runs N] [--json FILE]
(`python - --part model < scripts/sampler_cost.py` from another worktree measures that one's
engine: run as a file, the script imports the installed checkout's.)
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.frontend.llm import LLM
from engine.sample import sampler as sampler_module
from engine.sample.radix_cut import SUPPORTED_DIGIT_BITS, radix_cuts
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


def device_part(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--part device needs CUDA (or --device cpu: the interpreter)")
    vocab_size = args.vocab_size
    generator = torch.Generator(device=device).manual_seed(0)
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    rows_out: list[dict[str, Any]] = []
    print(f"{device_name}, vocabulary {vocab_size:,}\n"
          "| rows | logits' scale | filter | sort (ms) | "
          + " | ".join(f"radix, {bits} bits (ms)" for bits in SUPPORTED_DIGIT_BITS)
          + " | rows / tokens kept otherwise than by the sort |\n"
          "|---:|---:|---|---:|" + "---:|" * len(SUPPORTED_DIGIT_BITS) + "---|")
    for num_rows in args.rows:
        top_p = torch.full((num_rows,), 0.9, device=device)
        half_top_k = torch.where(torch.arange(num_rows, device=device) % 2 == 0, 50,
                                 vocab_size)
        for scale in (1.0, 8.0):
            logits = torch.randn(num_rows, vocab_size, device=device,
                                 generator=generator) * scale
            for name, top_k in (("top-p 0.9", None), ("top-p 0.9, top-k 50 on half", half_top_k)):
                searches: dict[str, Callable[[], torch.Tensor]] = {
                    "sort": functools.partial(apply_top_k_top_p, logits, top_k, top_p, None,
                                              "sort")}
                for bits in SUPPORTED_DIGIT_BITS:
                    searches[f"radix{bits}"] = functools.partial(_radix_masked, logits, top_k,
                                                                 top_p, bits)
                sorted_kept = searches["sort"]() != float("-inf")
                row = {"rows": num_rows, "scale": scale, "filter": name}
                for search, run in searches.items():
                    row[f"{search}_ms"] = _device_ms(run, device, args.calls, args.runs)
                    if search != "sort":
                        differs = (run() != float("-inf")) != sorted_kept
                        row[f"{search}_rows_differing"] = int(differs.any(dim=1).sum())
                        row[f"{search}_tokens_differing"] = int(differs.sum())
                rows_out.append(row)
                times = " | ".join(f"{row[f'{search}_ms']:.3f}" for search in searches)
                differing = ", ".join(
                    f"{bits} bits: {row[f'radix{bits}_rows_differing']} / "
                    f"{row[f'radix{bits}_tokens_differing']}" for bits in SUPPORTED_DIGIT_BITS)
                print(f"| {num_rows} | {scale} | {name} | {times} | {differing} |")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(
            {"device": device_name, "vocab_size": vocab_size, "rows": rows_out}, indent=2))


def _radix_masked(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor,
                  digit_bits: int) -> torch.Tensor:
    """What `apply_top_k_top_p` does under `search="radix"`, with `digit_bits` a pass."""
    cuts = radix_cuts(logits, top_k, top_p, digit_bits=digit_bits)
    return logits.masked_fill(logits < cuts.unsqueeze(1), float("-inf"))


def _device_ms(function: Callable[[], object], device: torch.device, calls: int,
               runs: int) -> float:
    """The median over `runs` of the mean milliseconds of `calls` calls, the device's queue
    drained before and after each run."""
    def drain() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    function()
    drain()
    mean_s = []
    for _ in range(runs):
        started_s = time.perf_counter()
        for _ in range(calls):
            function()
        drain()
        mean_s.append((time.perf_counter() - started_s) / calls)
    return 1000 * statistics.median(mean_s)


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
    parser.add_argument("--part", action="append", choices=["model", "filter", "device"])
    device_options = parser.add_argument_group("--part device")
    device_options.add_argument("--device", default="cuda",
                                help="cuda, or cpu under TRITON_INTERPRET=1 (a dry run)")
    device_options.add_argument("--vocab-size", type=int, default=128256)  # Llama-3's
    device_options.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    device_options.add_argument("--calls", type=int, default=20)
    device_options.add_argument("--runs", type=int, default=5)
    device_options.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()
    parts = args.part or ["model", "filter"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if "model" in parts:
        model_part()
    if "filter" in parts:
        filter_part()
    if "device" in parts:
        device_part(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
