"""Measures the decode attention kernel's tiles on a GPU and picks one per cache dtype.

For each cache dtype (bf16, and fp8 where the GPU has Triton's float8) every tile of
`decode_tile_candidates` runs `paged_decode_attention` at Llama-3.1-8B's decode shapes (32
query heads over 8 KV heads of dim 128, blocks of 16 tokens, each sequence's blocks drawn at
random from the pool; batch 1, 32 and 128 at 1k context, 32 at 8k), with the split count the
engine's decode graphs use when the longest shape fits. Calls are timed back to back from
Python, so a shape whose kernels take less than the wrapper's host time (on the H100 about
60 us a call: batch 1 and 32 at 1k) measures the host, not the tile; those are reported but
not scored. A tile's score is the geometric mean, over the scored shapes (batch 128 at 1k
and 32 at 8k), of its time over the current tile's (`decode_tile`); the lowest is chosen.
The report gives each tile's microseconds a call and the K/V bytes it read a second. The
engine reads its tiles from `triton_kernels._DECODE_TILES`, set by hand from this report
where the chosen tile beats the current one by 2 % or more.

Usage: python eval/gpu/decode_tiles.py [--device cuda|cpu] [--json FILE]
  --device cpu  a dry run under Triton's interpreter: tiny shapes, two tiles a dtype, and
                times that mean nothing
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cpu"]:
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from engine.model.attention import triton_kernels
from engine.model.attention.triton_kernels import (
    FP8_KV_DTYPE,
    DecodeTile,
    decode_tile,
    decode_tile_candidates,
    default_num_splits,
    paged_decode_attention,
)


@dataclass(frozen=True)
class Model:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    shapes: tuple[tuple[int, int], ...]  # (batch, context tokens)
    scored: tuple[tuple[int, int], ...]  # the shapes whose kernels outlast the host's call


LLAMA_8B = Model(32, 8, 128, 16, ((1, 1024), (32, 1024), (128, 1024), (32, 8192)),
                 ((128, 1024), (32, 8192)))
TINY = Model(4, 2, 32, 16, ((2, 48), (3, 100)), ((2, 48), (3, 100)))


@dataclass(frozen=True)
class TileTime:
    cache_dtype: str
    tile: DecodeTile
    batch: int
    context: int
    num_splits: int
    us_per_call: float | None
    kv_gb_per_s: float | None
    error: str | None = None


@dataclass(frozen=True)
class Layout:
    """One shape's inputs: caches of one dtype, each sequence's blocks drawn at random."""

    batch: int
    context: int
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query: torch.Tensor
    num_splits: int


def make_layout(model: Model, cache_dtype: torch.dtype, batch: int, context: int,
                device: str) -> Layout:
    generator = torch.Generator(device=device).manual_seed(batch * 7919 + context)
    blocks_per_seq = -(-context // model.block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks * model.block_size, model.num_kv_heads, model.head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=generator, device=device,
                                    dtype=torch.bfloat16).to(cache_dtype) for _ in range(2))
    block_table = torch.randperm(num_blocks, generator=generator, device=device).reshape(
        batch, blocks_per_seq).to(torch.int32)
    query = torch.randn(batch, model.num_heads, model.head_dim, generator=generator,
                        device=device, dtype=torch.bfloat16)
    # The decode graphs' rule: splits from the longest length the engine may see.
    num_splits = default_num_splits(max(c for _, c in model.shapes) + 64, model.block_size,
                                    batch, model.num_kv_heads)
    return Layout(batch, context, k_cache, v_cache, block_table,
                  torch.full((batch,), context, dtype=torch.int32, device=device), query,
                  num_splits)


def measure(model: Model, layout: Layout, tile: DecodeTile, device: str,
            calls: int) -> TileTime:
    """One tile at one shape: the median of five timed runs of `calls` calls, after two."""
    out = torch.empty_like(layout.query)

    def call() -> None:
        paged_decode_attention(layout.query, layout.k_cache, layout.v_cache,
                               layout.block_table, layout.seq_lens, model.head_dim ** -0.5,
                               block_size=model.block_size, num_splits=layout.num_splits,
                               out=out, tile=tile)

    name = str(layout.k_cache.dtype).removeprefix("torch.")
    try:
        runs_s = [_timed(call, calls, device) for _ in range(7)][2:]
    except Exception as error:  # a tile that does not compile or run is reported, not fatal
        return TileTime(name, tile, layout.batch, layout.context, layout.num_splits, None,
                        None, f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
    seconds = statistics.median(runs_s) / calls
    kv_bytes = (2 * layout.batch * layout.context * model.num_kv_heads * model.head_dim
                * layout.k_cache.element_size())
    return TileTime(name, tile, layout.batch, layout.context, layout.num_splits,
                    seconds * 1e6, kv_bytes / seconds / 1e9)


def _timed(call: Callable[[], None], calls: int, device: str) -> float:
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    started = time.perf_counter()
    for _ in range(calls):
        call()
    return time.perf_counter() - started


def choose(times: list[TileTime], current: DecodeTile,
           scored: Sequence[tuple[int, int]]) -> tuple[DecodeTile, float] | None:
    """The tile with the lowest geometric mean, over the `scored` (batch, context) shapes, of
    its time over the `current` tile's, and that mean (None if the current tile failed at
    one). A tile that failed at a scored shape is not chosen."""
    times = [t for t in times if (t.batch, t.context) in scored]
    baseline = {(t.batch, t.context): t.us_per_call for t in times if t.tile == current}
    if not baseline or any(us is None for us in baseline.values()):
        return None
    scores: dict[DecodeTile, list[float]] = {}
    for one in times:
        ratio = math.inf if one.us_per_call is None else (
            one.us_per_call / baseline[(one.batch, one.context)])
        scores.setdefault(one.tile, []).append(math.log(ratio))
    best = min(scores, key=lambda tile: sum(scores[tile]))
    return best, math.exp(sum(scores[best]) / len(scores[best]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--json", type=Path, help="write the report here too")
    args = parser.parse_args(argv)
    model = LLAMA_8B if args.device == "cuda" else TINY
    calls = 50 if args.device == "cuda" else 1
    cache_dtypes = [torch.bfloat16]
    if args.device == "cpu" or torch.cuda.get_device_capability() >= (8, 9):
        cache_dtypes.append(FP8_KV_DTYPE)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)"
    chosen_tiles: dict[str, object] = {}
    all_times: list[dict[str, object]] = []
    report = {"device": device, "torch": torch.__version__,
              "triton": triton_kernels.triton.__version__, "chosen": chosen_tiles,
              "times": all_times}
    for cache_dtype in cache_dtypes:
        current = decode_tile(cache_dtype)
        candidates = decode_tile_candidates(cache_dtype)
        if args.device == "cpu":
            candidates = candidates[:1] + candidates[-1:]
        candidates = [current] + [tile for tile in candidates if tile != current]
        times = []
        for batch, context in model.shapes:
            layout = make_layout(model, cache_dtype, batch, context, args.device)
            for tile in candidates:
                times.append(measure(model, layout, tile, args.device, calls))
                print(_line(times[-1]), flush=True)
            del layout
        chosen = choose(times, current, model.scored)
        name = str(cache_dtype).removeprefix("torch.")
        if chosen is not None:
            tile, score = chosen
            print(f"{name}: chosen {tile} ({score:.3f}x the current {current})", flush=True)
            chosen_tiles[name] = {"tile": tile._asdict(), "current": current._asdict(),
                                  "geomean_vs_current": score}
        all_times += [{**asdict(one), "tile": one.tile._asdict()} for one in times]
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def _line(result: TileTime) -> str:
    shape = f"{result.cache_dtype} b{result.batch} ctx{result.context} splits{result.num_splits}"
    if result.us_per_call is None:
        return f"{shape} {result.tile}: {result.error}"
    return (f"{shape} {result.tile}: {result.us_per_call:.1f} us, "
            f"{result.kv_gb_per_s:.0f} GB/s of K/V")


if __name__ == "__main__":
    sys.exit(main())
