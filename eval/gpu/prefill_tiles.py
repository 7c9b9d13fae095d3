"""Times the prefill attention kernel's tiles on a GPU, one call a layer.

At Llama-3.1-8B's attention shapes (32 query heads over 8 KV heads of dim 128, blocks of 16
tokens drawn at random from the pool, bf16) and six prefill steps (one prompt of 2,048;
four prompts of 512; eight of 256; four chunks of 512 over cached prefixes of 512; chunks of
128 over cached prefixes of 8,000 and 4,000 beside a prompt of 2,048; an agent's next turn,
a chunk of 256 over a cached prefix of 30,000, whose 128 programs leave an H100's 132 SMs
short of work unless their keys are split, and a chunk of 64 over the same), each tile given
(rows of queries x padded group, keys a tile, warps, stages) runs `_prefill_kernel` directly,
and `auto` runs `paged_prefill_attention` as the engine does (the autotuner's choice among
`_TUNED_PREFILL_TILES`, with the key splits of `default_prefill_splits`, which the tiles
take too). Where those split, `auto, 1 split` and `auto, N splits` (twice as many) time the
same call unsplit and split further. In the steps of prompts alone (no cached prefix) `sdpa`
attends as `triton-sdpa` does: torch's SDPA over each prompt's own K/V, one call a prompt. Each
variant's output is checked against auto's (the largest absolute difference, NaN if it left
a row unwritten). Three times a call, in microseconds:
- `us`: the device's, from a CUDA graph of the calls replayed (`do_bench_cudagraph`: no
  launches timed, the L2 cache warm from the call before);
- `eager_us`: `triton.testing.do_bench`'s median of device events around each eager call
  after an L2 flush. A call whose host work outlasts the flush's (about 80 us on an H100)
  holds the device idle inside its events, so a short kernel's `eager_us` includes part of
  its launch: the H100 runs of 6a474e2 and before reported only this time;
- `host_us`: the median host time of an eager call (its Python and launches; the device's
  queue drained every 20 calls, outside the timed calls).
Also printed: the tensor-core rate each reaches (the causal QK^T and PV products' FLOPs
over `us`). Run from another checkout (`python
OTHER/eval/gpu/prefill_tiles.py`), it times that checkout's kernel: two versions compared on
one device.

Usage: python eval/gpu/prefill_tiles.py [--tiles M,N,WARPS,STAGES ...] [--json FILE]
       [--device cuda|cpu]
  --device cpu  a dry run under Triton's interpreter: small shapes, times that mean nothing
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cpu"]:
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from engine.model.attention import triton_kernels
from engine.model.attention.triton_backend import causal_sdpa
from eval.gpu import kernel_timing

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
# (name, context tokens of each sequence, query tokens of each sequence)
# The mixed step: two short chunks over long cached prefixes (each sequence's costliest
# programs) beside a prompt, where the order of the programs matters most.
STEPS = (("1 x 2,048", (0,), (2048,)), ("4 x 512", (0,) * 4, (512,) * 4),
         ("8 x 256", (0,) * 8, (256,) * 8), ("4 x 512 over 512", (512,) * 4, (512,) * 4),
         ("128 over 8,000 and 4,000, 2,048", (8000, 4000, 0), (128, 128, 2048)),
         ("256 over 30,000", (30000,), (256,)), ("64 over 30,000", (30000,), (64,)))
CPU_STEPS = (("1 x 40", (0,), (40,)), ("2 x 8", (0, 0), (8, 8)),
             ("4 over 1,030", (1030,), (4,)), ("8 over 40, 24", (40, 0), (8, 24)))


def _device_times_us(fn: Callable[[], object]) -> dict[str, float | None]:
    """`fn`'s microseconds a call on CUDA: the device's from a graph's replay (None if its
    capture fails), the eager calls' in device events, and the host's (`eval.gpu.kernel_timing`)."""
    return {"us": kernel_timing.graph_us(fn), "eager_us": kernel_timing.eager_us(fn),
            "host_us": kernel_timing.host_us(fn, torch.cuda.synchronize)}


class PrefillStep:
    """One step's queries and a paged cache holding their sequences, blocks at random."""

    def __init__(self, context_lens: tuple[int, ...], query_lens: tuple[int, ...],
                 device: torch.device, generator: torch.Generator) -> None:
        seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
        blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
        order = torch.randperm(sum(blocks), generator=generator).numpy().astype(np.int32)
        table = np.zeros((len(seq_lens), max(blocks)), dtype=np.int32)
        start = 0
        for index, count in enumerate(blocks):
            table[index, :count] = order[start:start + count]
            start += count
        slots = sum(blocks) * BLOCK_SIZE
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.k_cache = torch.randn(slots, NUM_KV_HEADS, HEAD_DIM, generator=generator
                                   ).to(device, dtype)
        self.v_cache = torch.randn(slots, NUM_KV_HEADS, HEAD_DIM, generator=generator
                                   ).to(device, dtype)
        self.query = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, generator=generator
                                 ).to(device, dtype)
        self.block_table = torch.from_numpy(table).to(device)
        self.query_start_loc = torch.tensor(np.cumsum([0, *query_lens]), dtype=torch.int32,
                                            device=device)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        self.max_query_len = max(query_lens)
        self.prompts_only = not any(context_lens)
        self.num_splits = triton_kernels.default_prefill_splits(
            query_lens, max(seq_lens), NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)
        # Each token's K/V in step order, as the layer hands them to attention.
        slot_ids = [int(table[index, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE
                    for index, seq_len in enumerate(seq_lens)
                    for pos in range(seq_len - query_lens[index], seq_len)]
        self.key = self.k_cache[slot_ids]
        self.value = self.v_cache[slot_ids]
        ends = np.cumsum(query_lens)
        self.spans = [(int(end - q), int(end)) for q, end in zip(query_lens, ends, strict=True)]
        self.out = torch.empty_like(self.query)
        self.scale = HEAD_DIM ** -0.5
        # causal pairs (query, key) of each sequence, times two products of HEAD_DIM MACs
        pairs = sum(q * c + q * (q + 1) // 2 for c, q in zip(context_lens, query_lens,
                                                             strict=True))
        self.flops = pairs * NUM_HEADS * HEAD_DIM * 4

    def auto(self, num_splits: int | None = None) -> None:
        """The engine's call: the autotuner's tile, the rule's splits unless given."""
        triton_kernels.paged_prefill_attention(
            self.query, self.k_cache, self.v_cache, self.block_table, self.query_start_loc,
            self.seq_lens, self.scale, block_size=BLOCK_SIZE, max_query_len=self.max_query_len,
            out=self.out, num_splits=self.num_splits if num_splits is None else num_splits)

    def sdpa(self) -> None:
        """SDPA's part of a step of prompts alone in `triton-sdpa`: a call a prompt."""
        if len(self.spans) == 1:  # as the backend, which then returns SDPA's output itself
            causal_sdpa(self.query, self.key, self.value, self.scale)
            return
        for start, end in self.spans:
            self.out[start:end] = causal_sdpa(self.query[start:end], self.key[start:end],
                                               self.value[start:end], self.scale)

    def sdpa_checked(self) -> None:
        """`sdpa`, its output written to `out` (a copy `sdpa` leaves out for one prompt)."""
        if len(self.spans) == 1:
            self.out.copy_(causal_sdpa(self.query, self.key, self.value, self.scale))
        else:
            self.sdpa()

    def tile(self, block_m: int, block_n: int, num_warps: int, num_stages: int) -> None:
        triton_kernels._launch_prefill(
            self.query, self.k_cache, self.v_cache, self.block_table, self.query_start_loc,
            self.seq_lens, self.out, self.scale, block_size=BLOCK_SIZE,
            max_query_len=self.max_query_len, sliding_window=None,
            tile=triton_kernels._TileConfig(block_m, block_n, num_warps, num_stages),
            num_splits=self.num_splits)


def _us(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiles", nargs="+", default=None, metavar="M,N,WARPS,STAGES")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    tiles = ([tuple(int(part) for part in tile.split(",")) for tile in args.tiles]
             if args.tiles else list(triton_kernels._TUNED_PREFILL_TILES))
    if device.type == "cpu":
        tiles = [(32, 32, 4, 1)]
    generator = torch.Generator().manual_seed(0)
    rows = []
    for name, context_lens, query_lens in (STEPS if device.type == "cuda" else CPU_STEPS):
        step = PrefillStep(context_lens, query_lens, device, generator)
        variants: list[tuple[str, Callable[[], None]]] = [("auto", step.auto)]
        variants += [(",".join(map(str, tile)), functools.partial(step.tile, *tile))
                     for tile in tiles]
        if step.num_splits > 1:
            more = min(2 * step.num_splits, 64)
            variants += [("auto, 1 split", functools.partial(step.auto, 1)),
                         (f"auto, {more} splits", functools.partial(step.auto, more))]
        if step.prompts_only:
            variants.append(("sdpa", step.sdpa))
        reference = None  # auto's output, the first variant's
        for label, fn in variants:
            step.out.fill_(float("nan"))
            started = time.perf_counter()
            (step.sdpa_checked if label == "sdpa" else fn)()
            checked_us = (time.perf_counter() - started) * 1e6
            if reference is None:
                reference = step.out.clone()
            error = (step.out.float() - reference.float()).abs().max().item()
            # Under the interpreter the checked call's time is the dry run's (it means nothing).
            times = (_device_times_us(fn) if device.type == "cuda" else
                     {"us": checked_us, "eager_us": checked_us, "host_us": checked_us})
            us = times["us"]
            rows.append({"step": name, "tile": label, "num_splits": step.num_splits, **times,
                         "tflops": None if us is None else step.flops / (us * 1e-6) / 1e12,
                         "max_diff_vs_auto": error})
    source = Path(triton_kernels.__file__).resolve()
    print(f"prefill attention, {NUM_HEADS} heads over {NUM_KV_HEADS}, head dim {HEAD_DIM}, "
          f"kernel of {source}")
    print("| step | tile (rows, keys, warps, stages), or sdpa | us a layer (graph) | eager us "
          "(events) | host us a call | TFLOP/s | max diff vs auto |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['step']} | {row['tile']} | {_us(row['us'])} | {_us(row['eager_us'])} | "
              f"{_us(row['host_us'])} | {_us(row['tflops'], '.0f')} | "
              f"{row['max_diff_vs_auto']:.2g} |")
    timed = [row for row in rows if row["us"] is not None]
    best = {name: min((row for row in timed if row["step"] == name), key=lambda row: row["us"])
            for name in dict.fromkeys(row["step"] for row in timed)}
    print("fastest on the device: " + "; ".join(f"{name}: {row['tile']} ({row['us']:.1f} us)"
                                                for name, row in best.items()))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(
            {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
             "kernel": str(source), "rows": rows,
             "median_us": statistics.median(row["us"] for row in timed) if timed else None},
            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
