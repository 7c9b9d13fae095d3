"""The Triton paged-attention kernels against a plain torch reference on random paged layouts.

Without a GPU the kernels run under Triton's interpreter (each program instance in numpy), so
every shape here is tiny. Cache slots that hold no token of a sequence are NaN: a kernel that
read a key or value it should not (past a sequence's end, a padding row's blocks, the padded
end of a block table row) would return NaN.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import triton
import triton.language as tl

from engine.model.attention import triton_kernels
from engine.model.attention.backend import write_kv
from engine.model.attention.triton_kernels import (
    FP8_KV_DTYPE,
    DecodeTile,
    _decode_program,
    _prefill_program,
    decode_tile_candidates,
    default_num_splits,
    default_prefill_splits,
    paged_decode_attention,
    paged_prefill_attention,
    store_kv,
    supports,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCES = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


@dataclass(frozen=True)
class PagedLayout:
    """One layer's K/V caches [slots, kv_heads, head_dim] and the sequences' block tables."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: list[int]
    block_size: int


def make_layout(
    seq_lens: list[int], *, block_size: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype = torch.float32, shared_blocks: int = 0, seed: int = 0,
) -> PagedLayout:
    """Caches of `dtype` with sequences on blocks drawn from a shuffled pool; sequence 1
    starts with the first `shared_blocks` blocks of sequence 0 (a shared prefix). Every slot
    outside a sequence, and the spare blocks that pad the block table rows, hold NaN."""
    generator = torch.Generator().manual_seed(seed)
    needed = [-(-seq_len // block_size) for seq_len in seq_lens]
    spare = 2
    num_blocks = sum(needed) - shared_blocks + spare
    pool = torch.randperm(num_blocks, generator=generator).tolist()
    spare_ids, pool = pool[:spare], pool[spare:]
    max_blocks = max(needed) + 1
    table = [[spare_ids[i % spare] for i in range(max_blocks)] for _ in seq_lens]
    for index, count in enumerate(needed):
        shared = shared_blocks if index == 1 else 0
        table[index][:shared] = table[0][:shared]
        table[index][shared:count] = [pool.pop() for _ in range(count - shared)]
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator)
    v_cache = torch.randn(shape, generator=generator)
    used = torch.zeros(shape[0], dtype=torch.bool)
    for row, seq_len in zip(table, seq_lens, strict=True):
        used[_slots(row, seq_len, block_size)] = True
    k_cache[~used] = float("nan")
    v_cache[~used] = float("nan")
    return PagedLayout(
        k_cache=k_cache.to(DEVICE, dtype), v_cache=v_cache.to(DEVICE, dtype),
        block_table=torch.tensor(table, dtype=torch.int32, device=DEVICE),
        seq_lens=list(seq_lens), block_size=block_size,
    )


def _slots(block_ids: list[int], seq_len: int, block_size: int) -> torch.Tensor:
    positions = torch.arange(seq_len)
    return torch.tensor(block_ids, dtype=torch.long)[positions // block_size] * block_size + (
        positions % block_size)


def reference_attention(
    query: torch.Tensor, layout: PagedLayout, query_lens: list[int], scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Per sequence: gather its K/V through the block table in float32, mask causally (and to
    the window), softmax. Query rows are the sequences' last positions, in order."""
    num_heads = query.shape[1]
    group = num_heads // layout.k_cache.shape[1]
    out = torch.zeros(query.shape, dtype=torch.float32)
    start = 0
    for row, seq_len, query_len in zip(layout.block_table.tolist(), layout.seq_lens,
                                       query_lens, strict=True):
        rows = slice(start, start + query_len)
        start += query_len
        if seq_len == 0:
            continue
        slots = _slots(row, seq_len, layout.block_size)
        keys = layout.k_cache.cpu()[slots].float().repeat_interleave(group, dim=1)
        values = layout.v_cache.cpu()[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[rows].cpu().float(), keys) * scale
        key_pos = torch.arange(seq_len)
        query_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
        allowed = key_pos <= query_pos
        if sliding_window is not None:
            allowed &= key_pos > query_pos - sliding_window
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out[rows] = torch.einsum("hqk,khd->qhd", probs, values)
    return out


def run_decode(
    seq_lens: list[int], *, group: int, num_kv_heads: int, head_dim: int = 32,
    block_size: int = 8, num_splits: int = 2, dtype: torch.dtype = torch.float32,
    sliding_window: int | None = None, shared_blocks: int = 0, seed: int = 0,
    cache_dtype: torch.dtype | None = None, tile: DecodeTile | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode kernel's output (with `tile`, else the default) and the reference's (over
    the same cache values), both float32 on the CPU; the caches hold `cache_dtype` (default:
    the query's `dtype`)."""
    layout = make_layout(seq_lens, block_size=block_size, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, dtype=cache_dtype or dtype,
                         shared_blocks=shared_blocks, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(len(seq_lens), num_kv_heads * group, head_dim,
                        generator=generator).to(DEVICE, dtype)
    scale = head_dim ** -0.5
    out = paged_decode_attention(
        query, layout.k_cache, layout.v_cache, layout.block_table,
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), scale,
        block_size=block_size, num_splits=num_splits, sliding_window=sliding_window,
        tile=tile,
    )
    expected = reference_attention(query, layout, [1] * len(seq_lens), scale, sliding_window)
    return out.cpu().float(), expected


def run_prefill(
    context_lens: list[int], query_lens: list[int], *, group: int, num_kv_heads: int,
    head_dim: int = 32, block_size: int = 8, dtype: torch.dtype = torch.float32,
    sliding_window: int | None = None, shared_blocks: int = 0, seed: int = 0,
    cache_dtype: torch.dtype | None = None, tile: tuple[int, int, int, int] | None = None,
    max_query_len: int | None = None, num_splits: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill kernel's output and the reference's (over the same cache values), both
    float32 on the CPU; the caches hold `cache_dtype` (default: the query's `dtype`).
    `tile` (rows, keys, warps, stages) launches the kernel with that tile, as the autotuner
    would, instead of `paged_prefill_attention`'s choice; `max_query_len` may overstate the
    longest query (None: the longest); `num_splits` splits each program's keys."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    layout = make_layout(seq_lens, block_size=block_size, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, dtype=cache_dtype or dtype,
                         shared_blocks=shared_blocks, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(sum(query_lens), num_kv_heads * group, head_dim,
                        generator=generator).to(DEVICE, dtype)
    query_start_loc = torch.tensor(np.cumsum([0, *query_lens]), dtype=torch.int32,
                                   device=DEVICE)
    scale = head_dim ** -0.5
    args = (query, layout.k_cache, layout.v_cache, layout.block_table, query_start_loc,
            torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE))
    max_query_len = max(query_lens) if max_query_len is None else max_query_len
    if tile is None:
        out = paged_prefill_attention(*args, scale, block_size=block_size,
                                      max_query_len=max_query_len,
                                      sliding_window=sliding_window, num_splits=num_splits)
    else:
        out = torch.full_like(query, float("nan"))
        triton_kernels._launch_prefill(*args, out, scale, block_size=block_size,
                                       max_query_len=max_query_len,
                                       sliding_window=sliding_window,
                                       tile=triton_kernels._TileConfig(*tile),
                                       num_splits=num_splits)
    expected = reference_attention(query, layout, query_lens, scale, sliding_window)
    return out.cpu().float(), expected


def assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


# Decode: lengths at and across block boundaries (block_size 8), a single token, a padding
# row and a ragged longer one; sequences 0 and 1 share their first block.
DECODE_LENS = [9, 23, 8, 7, 1, 0]


@pytest.mark.parametrize("group", [1, 2, 3, 4, 7, 8])
def test_decode_matches_reference_for_each_gqa_ratio(group: int) -> None:
    num_kv_heads = 2 if group <= 4 else 1
    out, expected = run_decode(DECODE_LENS, group=group, num_kv_heads=num_kv_heads,
                               shared_blocks=1, seed=group)
    assert_matches(out, expected, torch.float32)
    assert (out[DECODE_LENS.index(0)] == 0).all()


@pytest.mark.parametrize("num_splits", [1, 3, 64])
def test_decode_long_context_over_many_splits(num_splits: int) -> None:
    # 38 blocks of 8 for the long sequence, 9 for the short one: 64 splits leave most empty.
    out, expected = run_decode([300, 70, 0], group=2, num_kv_heads=2, head_dim=64,
                               num_splits=num_splits)
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("sliding_window", [1, 8, 13, 100])
def test_decode_sliding_window(sliding_window: int) -> None:
    out, expected = run_decode([9, 16, 17, 150, 0], group=2, num_kv_heads=1, num_splits=3,
                               sliding_window=sliding_window)
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize(("dtype", "head_dim"), [(torch.bfloat16, 128), (torch.float16, 64)],
                         ids=["bfloat16-d128", "float16-d64"])
def test_decode_half_precision(dtype: torch.dtype, head_dim: int) -> None:
    out, expected = run_decode([33, 5, 0, 16], group=4, num_kv_heads=1, head_dim=head_dim,
                               dtype=dtype)
    assert_matches(out, expected, dtype)


def test_decode_padding_rows_give_zeros_and_fill_out() -> None:
    layout = make_layout([0, 0], block_size=8, num_kv_heads=1, head_dim=32)
    query = torch.randn(2, 2, 32, device=DEVICE)
    seq_lens = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    for num_splits in (1, 4):
        out = torch.full_like(query, float("nan"))
        result = paged_decode_attention(query, layout.k_cache, layout.v_cache,
                                        layout.block_table, seq_lens, 1.0, block_size=8,
                                        num_splits=num_splits, out=out)
        assert result is out
        assert (out == 0).all()


# Prefill: plain prefills (no context), single-token and longer chunks over a cached context
# ending at, before and after a block boundary.
CONTEXT_LENS = [0, 8, 3, 0, 17]
QUERY_LENS = [9, 1, 14, 1, 7]


@pytest.mark.parametrize("group", [1, 2, 3, 4, 7, 8])
def test_prefill_matches_reference_for_each_gqa_ratio(group: int) -> None:
    num_kv_heads = 2 if group <= 4 else 1
    out, expected = run_prefill(CONTEXT_LENS, QUERY_LENS, group=group,
                                num_kv_heads=num_kv_heads, seed=group)
    assert_matches(out, expected, torch.float32)


def test_prefill_long_queries_over_several_query_and_key_tiles() -> None:
    # 150 queries and 190 keys span several query tiles and key tiles (32 or 64 of each).
    out, expected = run_prefill([40, 0], [150, 70], group=1, num_kv_heads=1)
    assert_matches(out, expected, torch.float32)


# Key splits: a program's key tiles shared out among `num_splits` programs whose partials a
# reduction combines. A row may see no key of its split (past the causal diagonal) and must
# then weigh nothing.
def test_prefill_splits_keys_over_cached_contexts() -> None:
    # 3 splits of the long sequence's 10 key tiles (4, 4 and 2), and of the other programs'
    # 1 to 3 tiles, some splits empty.
    out, expected = run_prefill([300, 0, 61], [20, 40, 5], group=2, num_kv_heads=2,
                                shared_blocks=2, num_splits=3)
    assert_matches(out, expected, torch.float32)


def test_prefill_splits_past_a_short_key_range_find_no_tile() -> None:
    out, expected = run_prefill([100], [3], group=1, num_kv_heads=1, num_splits=64)
    assert_matches(out, expected, torch.float32)


def test_prefill_splits_in_a_sliding_window() -> None:
    # Programs whose window starts past their last key tile (no tile in any split), and
    # masked tiles at the window's edge inside one split.
    out, expected = run_prefill([150, 0], [30, 50], group=4, num_kv_heads=1, num_splits=3,
                                sliding_window=45)
    assert_matches(out, expected, torch.float32)


def test_prefill_splits_with_a_tuned_tile_in_bfloat16() -> None:
    # As the autotuner's split variant runs on the device: a 16-bit tile, and an overstated
    # max_query_len whose extra rounds find no query.
    out, expected = run_prefill([150, 0, 5], [24, 40, 1], group=4, num_kv_heads=2,
                                head_dim=64, block_size=16, dtype=torch.bfloat16,
                                tile=(64, 64, 4, 2), max_query_len=50, num_splits=3)
    assert_matches(out, expected, torch.bfloat16)


def test_prefill_rejects_split_counts_out_of_range() -> None:
    layout = make_layout([5], block_size=8, num_kv_heads=1, head_dim=32)
    for num_splits in (0, 65):
        with pytest.raises(ValueError, match="num_splits must be from 1 to 64"):
            paged_prefill_attention(
                torch.zeros(5, 1, 32, device=DEVICE), layout.k_cache, layout.v_cache,
                layout.block_table, torch.tensor([0, 5], dtype=torch.int32, device=DEVICE),
                torch.tensor([5], dtype=torch.int32, device=DEVICE), 1.0, block_size=8,
                max_query_len=5, num_splits=num_splits)


def test_default_prefill_splits() -> None:
    llama = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
    # A full-budget prompt fills the card; so do many chunks.
    assert default_prefill_splits([2048], 2048, **llama) == 1
    assert default_prefill_splits([64] * 40, 30_000, **llama) == 1
    # An agent's next turn: 256 tokens over 30,000 cached make 128 programs, so 3 splits.
    assert default_prefill_splits([256], 30_256, **llama) == 3
    # Short contexts keep 512 keys a split; partials stay within their bytes.
    assert default_prefill_splits([16], 700, **llama) == 1
    assert default_prefill_splits([16], 1100, **llama) == 2
    for query_lens in ([2], [16], [64, 300], [512]):
        for max_seq_len in (600, 5000, 130_000):
            splits = default_prefill_splits(query_lens, max_seq_len, **llama)
            assert 1 <= splits <= 64
            partial_bytes = sum(query_lens) * 32 * 130 * 4 * splits
            assert splits == 1 or partial_bytes <= triton_kernels.PREFILL_PARTIALS_BYTES
    assert default_prefill_splits([], 100, **llama) == 1
    # In a window a program reaches its query tile's window (16 queries here), not the
    # context, however long the chunk.
    assert default_prefill_splits([16], 30_016, **llama) == 33
    assert default_prefill_splits([16], 30_016, **llama, sliding_window=4096) == 8
    assert default_prefill_splits([16], 30_016, **llama, sliding_window=500) == 1
    assert default_prefill_splits([256], 30_256, **llama, sliding_window=1000) == 1


def test_prefill_programs_cover_every_query_tile_head_and_sequence() -> None:
    # The grid is flat, last query tiles first: 3 KV heads x 3 sequences x up to 5 query
    # tiles, sequences with fewer tiles than the longest among them.
    out, expected = run_prefill([40, 0, 5], [150, 70, 33], group=2, num_kv_heads=3)
    assert_matches(out, expected, torch.float32)


@triton.jit
def _prefill_order_probe(query_start_loc_ptr, out_ptr, num_seqs, num_splits,
                         NUM_KV_HEADS: tl.constexpr, BLOCK_Q: tl.constexpr):
    program = tl.program_id(0)
    kv_head, split, seq, q_tile, _, _ = _prefill_program(
        program, query_start_loc_ptr, num_seqs, num_splits, NUM_KV_HEADS, BLOCK_Q)
    tl.store(out_ptr + program * 4, kv_head)
    tl.store(out_ptr + program * 4 + 1, seq)
    tl.store(out_ptr + program * 4 + 2, q_tile)
    tl.store(out_ptr + program * 4 + 3, split)


@triton.jit
def _decode_order_probe(out_ptr, num_kv_heads, num_splits):
    program = tl.program_id(0)
    kv_head, split, seq = _decode_program(program, num_kv_heads, num_splits)
    tl.store(out_ptr + program * 3, kv_head)
    tl.store(out_ptr + program * 3 + 1, split)
    tl.store(out_ptr + program * 3 + 2, seq)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_prefill_dispatches_every_sequences_last_query_tiles_first(num_splits: int) -> None:
    # A cached prefix's chunk (7 queries) beside longer prompts: its one tile, the costliest
    # of its sequence, goes in the first round with every sequence's last tile, every key
    # split of a tile together.
    query_lens, block_q, num_kv_heads = [40, 7, 100], 16, 2
    num_rounds = -(-max(query_lens) // block_q)
    per_round = num_kv_heads * num_splits * len(query_lens)
    order = torch.full((num_rounds * per_round, 4), -9, dtype=torch.int32, device=DEVICE)
    query_start_loc = torch.tensor(np.cumsum([0, *query_lens]), dtype=torch.int32,
                                   device=DEVICE)
    _prefill_order_probe[(order.shape[0],)](query_start_loc, order, len(query_lens),
                                            num_splits, NUM_KV_HEADS=num_kv_heads,
                                            BLOCK_Q=block_q)
    programs = [tuple(row) for row in order.tolist()]
    live = [program for program in programs if program[2] >= 0]
    assert sorted(live) == sorted(
        (head, seq, tile, split) for seq, n in enumerate(query_lens)
        for tile in range(-(-n // block_q)) for head in range(num_kv_heads)
        for split in range(num_splits))
    first_round = programs[:per_round]
    assert sorted((seq, tile) for _, seq, tile, _ in first_round) == sorted(
        (seq, -(-n // block_q) - 1) for seq, n in enumerate(query_lens)
        for _ in range(num_kv_heads * num_splits))
    for seq in range(len(query_lens)):  # each sequence's tiles from its last, heads together
        mine = [(tile, split, head) for head, s, tile, split in live if s == seq]
        assert mine == sorted(mine, key=lambda p: (-p[0], p[1], p[2]))


def test_decode_dispatches_a_sequences_heads_and_splits_together_in_sequence_order() -> None:
    num_kv_heads, num_splits, batch = 2, 3, 4
    order = torch.full((num_kv_heads * num_splits * batch, 3), -9, dtype=torch.int32,
                       device=DEVICE)
    _decode_order_probe[(order.shape[0],)](order, num_kv_heads, num_splits)
    programs = [tuple(row) for row in order.tolist()]
    assert sorted(programs) == sorted((head, split, seq) for head in range(num_kv_heads)
                                      for split in range(num_splits) for seq in range(batch))
    assert [seq for _, _, seq in programs] == sorted(seq for _, _, seq in programs)
    assert [head for head, _, _ in programs[:num_kv_heads]] == list(range(num_kv_heads))


@pytest.mark.parametrize("tile", triton_kernels._TUNED_PREFILL_TILES,
                         ids=lambda tile: ",".join(map(str, tile)))
def test_each_tuned_prefill_tile_matches_reference(tile: tuple[int, int, int, int]) -> None:
    # The autotuner's tiles run on CUDA only; here each one over the causal diagonal, whole
    # key tiles and a cached prefix, in bfloat16 as on the device.
    out, expected = run_prefill([0, 70], [150, 60], group=4, num_kv_heads=2, head_dim=64,
                                block_size=16, dtype=torch.bfloat16, tile=tile)
    assert_matches(out, expected, torch.bfloat16)


def test_prefill_rounds_past_every_sequences_queries_write_nothing() -> None:
    # max_query_len overstated (the grid's extra rounds find no query), a window, a tuned
    # tile, and a chunk of one query over a cached prefix beside prompts.
    out, expected = run_prefill([30, 0, 5], [9, 40, 1], group=4, num_kv_heads=1,
                                head_dim=64, block_size=16, dtype=torch.bfloat16,
                                sliding_window=13, tile=(64, 64, 4, 3), max_query_len=100)
    assert_matches(out, expected, torch.bfloat16)


def test_prefill_extends_two_sequences_sharing_prefix_blocks() -> None:
    out, expected = run_prefill([24, 19], [5, 12], group=2, num_kv_heads=2, shared_blocks=2)
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("sliding_window", [1, 8, 13])
def test_prefill_sliding_window(sliding_window: int) -> None:
    out, expected = run_prefill([0, 30, 5], [40, 9, 1], group=4, num_kv_heads=1,
                                sliding_window=sliding_window)
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("sliding_window", [45, 100])
def test_prefill_long_sliding_window_over_whole_and_edge_key_tiles(sliding_window: int) -> None:
    # Windows wider than a key tile (32 or 64 positions): a query tile's keys run from masked
    # tiles at the window's edge through whole tiles, which skip the mask, to the diagonal.
    out, expected = run_prefill([60, 0], [150, 130], group=2, num_kv_heads=2,
                                sliding_window=sliding_window)
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize(("dtype", "head_dim", "block_size"), [
    (torch.float32, 128, 16), (torch.bfloat16, 64, 8), (torch.float16, 32, 32),
], ids=["float32-d128-b16", "bfloat16-d64-b8", "float16-d32-b32"])
def test_prefill_dtypes_head_dims_and_block_sizes(
    dtype: torch.dtype, head_dim: int, block_size: int,
) -> None:
    out, expected = run_prefill([0, 21], [12, 6], group=2, num_kv_heads=1, head_dim=head_dim,
                                block_size=block_size, dtype=dtype)
    assert_matches(out, expected, dtype)


def test_prefill_writes_into_out() -> None:
    layout = make_layout([5], block_size=8, num_kv_heads=1, head_dim=32)
    query = torch.randn(5, 1, 32, device=DEVICE)
    out = torch.full_like(query, float("nan"))
    result = paged_prefill_attention(
        query, layout.k_cache, layout.v_cache, layout.block_table,
        torch.tensor([0, 5], dtype=torch.int32, device=DEVICE),
        torch.tensor([5], dtype=torch.int32, device=DEVICE), 0.5, block_size=8,
        max_query_len=5, out=out,
    )
    assert result is out
    torch.testing.assert_close(out.cpu(), reference_attention(query, layout, [5], 0.5),
                               **TOLERANCES[torch.float32])


def test_supports_and_rejects_unsupported_shapes() -> None:
    assert supports(128, 16)
    assert supports(32, 8)
    assert not supports(48, 16)
    assert not supports(64, 4)
    assert not supports(64, 24)
    layout = make_layout([4], block_size=8, num_kv_heads=1, head_dim=32)
    seq_lens = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim 48"):
        paged_decode_attention(torch.zeros(1, 1, 48, device=DEVICE), layout.k_cache,
                               layout.v_cache, layout.block_table, seq_lens, 1.0,
                               block_size=8, num_splits=1)
    for block_size in (4, 12):
        with pytest.raises(ValueError, match=f"block_size {block_size}"):
            paged_prefill_attention(
                torch.zeros(4, 1, 32, device=DEVICE), layout.k_cache, layout.v_cache,
                layout.block_table, torch.tensor([0, 4], dtype=torch.int32, device=DEVICE),
                seq_lens, 1.0, block_size=block_size, max_query_len=4,
            )


def test_default_num_splits() -> None:
    assert default_num_splits(100, 16, batch=64, num_kv_heads=8) == 1
    assert default_num_splits(32768, 16, batch=1, num_kv_heads=8) == 32
    for max_seq_len in (1, 100, 1000, 10_000, 100_000):
        for batch in (1, 4, 64, 256):
            splits = default_num_splits(max_seq_len, 16, batch, num_kv_heads=8)
            assert splits >= 1 and splits & (splits - 1) == 0
            assert splits <= default_num_splits(max_seq_len * 2, 16, batch, num_kv_heads=8)
            assert splits >= default_num_splits(max_seq_len, 16, batch * 2, num_kv_heads=8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_strided_rows_at_their_slots_like_index_copies(dtype: torch.dtype
                                                                       ) -> None:
    generator = torch.Generator().manual_seed(7)
    tokens, num_heads, num_kv_heads, head_dim, num_slots = 5, 6, 3, 32, 40
    sizes = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
    qkv = torch.randn(tokens, sum(sizes), generator=generator).to(DEVICE, dtype)
    _, key, value = (part.view(tokens, -1, head_dim) for part in qkv.split(sizes, dim=-1))
    slots = torch.tensor([3, 17, 0, 39, 8], device=DEVICE)
    cache = torch.randn(2, num_slots, num_kv_heads, head_dim, generator=generator).to(
        DEVICE, dtype)
    expected = cache.clone()
    write_kv(expected, key, value, slots)

    store_kv(key, value, cache[0], cache[1], slots)

    assert torch.equal(cache, expected)
    with pytest.raises(ValueError, match="slots has shape"):
        store_kv(key, value, cache[0], cache[1], slots[:2])


def test_tuned_prefill_tiles_cover_every_group_and_include_the_untuned_rule() -> None:
    from engine.model.attention import triton_kernels

    configs = triton_kernels._tuned_prefill_kernel.configs
    for group_pad in (1, 2, 4, 8, 16, 32, 64, 128):
        tiles = {(config.kwargs["BLOCK_Q"] * group_pad, config.kwargs["BLOCK_N"],
                  config.num_warps, config.num_stages)
                 for config in triton_kernels._prune_prefill_configs(
                     configs, {}, GROUP_PAD=group_pad)}
        assert tiles and tiles <= set(triton_kernels._TUNED_PREFILL_TILES)
        for head_dim in (64, 128):
            rule = triton_kernels._prefill_config(group_pad, head_dim, torch.bfloat16)
            if group_pad <= 16:  # the groups of real models: 1 to 16 query heads a KV head
                assert tuple(rule) in tiles


# Arguments that change from step to step, by kernel: none may be compile-time, or a live
# step stalls while Triton compiles a variant for its value (most of a second for prefill).
STEP_VARYING_ARGUMENTS = {
    "_decode_split_kernel": {"stride_bt", "num_splits"},
    "_decode_reduce_kernel": {"num_splits"},
    "_prefill_kernel": {"stride_bt", "num_seqs", "num_splits"},
    "_prefill_reduce_kernel": {"num_splits"},
}


def test_step_varying_arguments_are_neither_constexpr_nor_specialised() -> None:
    # The interpreter, which this suite uses without a GPU, keeps no parameter list: read the
    # compiled kernels' in a process without it.
    script = (
        "import json\n"
        "from engine.model.attention import triton_kernels as k\n"
        "print(json.dumps({name: {p.name: [p.is_constexpr, p.do_not_specialize]\n"
        "                  for p in getattr(k, name).params}\n"
        f"                 for name in {sorted(STEP_VARYING_ARGUMENTS)!r}}}))\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, check=True, timeout=120)
    params = json.loads(result.stdout)
    for kernel, names in STEP_VARYING_ARGUMENTS.items():
        for name in names:
            assert params[kernel][name] == [False, True], (kernel, name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles only on a CUDA device")
def test_steps_of_new_shapes_compile_nothing_new() -> None:
    def compiled() -> int:
        from engine.model.attention import triton_kernels as k
        kernels = [k._decode_split_kernel, k._decode_reduce_kernel, k._prefill_kernel,
                   k._prefill_reduce_kernel]
        return sum(len(kernel.device_caches[torch.cuda.current_device()][0])
                   for kernel in kernels)

    def steps(shapes: tuple[tuple[int, int], ...]) -> None:
        for width, num_splits in shapes:  # block table width in blocks (of 8), splits
            run_decode([width * 8 - 15, 8], group=2, num_kv_heads=2, num_splits=num_splits)
            run_prefill([0, width * 8 - 16], [9, 8], group=2, num_kv_heads=2,
                        num_splits=num_splits)

    steps(((3, 1), (3, 2)))  # each kernel once, with and without splits
    before = compiled()
    # Row strides of every divisibility class (16 and 32 are multiples of 16), 1 to 64 splits.
    steps(((2, 4), (16, 1), (17, 8), (32, 64), (40, 3)))
    assert compiled() == before


# An fp8 cache (kv_cache_dtype fp8): the kernels widen its values to the query's dtype (the
# decode kernel's fp8 tile to float16, for a 16-bit query), so against a reference over the
# same (rounded) cache values they are as exact as with a cache of the query's dtype.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_and_prefill_read_an_fp8_cache(dtype: torch.dtype) -> None:
    out, expected = run_decode([300, 70, 9, 0], group=4, num_kv_heads=2, head_dim=64,
                               num_splits=4, dtype=dtype, shared_blocks=1,
                               cache_dtype=FP8_KV_DTYPE)
    assert_matches(out, expected, dtype)
    out, expected = run_prefill(CONTEXT_LENS, QUERY_LENS, group=2, num_kv_heads=2,
                                dtype=dtype, cache_dtype=FP8_KV_DTYPE)
    assert_matches(out, expected, dtype)


def _tiles(cache_dtype: torch.dtype) -> list[DecodeTile]:
    """Every candidate on a GPU; under the interpreter, where warps and stages change
    nothing, one of each key count and widening."""
    candidates = decode_tile_candidates(cache_dtype)
    if DEVICE == "cuda":
        return candidates
    return list(dict.fromkeys(DecodeTile(tile.block_n, 4, 2, tile.widen_to_f16)
                              for tile in candidates))


# The tiles the GPU sweep (eval/gpu/decode_tiles.py) chooses among compute the same attention:
# wider key tiles, and a float8 cache widened to float16 with the scale in the query; with
# and without splits, and in a sliding window.
@pytest.mark.parametrize(("cache_dtype", "tile"), [
    (cache_dtype, tile) for cache_dtype in (torch.bfloat16, FP8_KV_DTYPE)
    for tile in _tiles(cache_dtype)
], ids=str)
def test_decode_tiles_compute_the_same_attention(cache_dtype: torch.dtype,
                                                 tile: DecodeTile) -> None:
    for num_splits, sliding_window in ((4, None), (1, None), (3, 40)):
        out, expected = run_decode([300, 70, 9, 0], group=4, num_kv_heads=2, head_dim=64,
                                   num_splits=num_splits, dtype=torch.bfloat16,
                                   shared_blocks=1, cache_dtype=cache_dtype, tile=tile,
                                   sliding_window=sliding_window)
        assert_matches(out, expected, torch.bfloat16)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's numpy
def test_a_widened_tile_keeps_a_nan_query_nan() -> None:
    """The clamp into float16's range must not turn a NaN (a broken model) into a finite
    value, on a GPU (whose min and max drop NaN operands) as under the interpreter."""
    layout = make_layout([9], block_size=8, num_kv_heads=1, head_dim=32, dtype=FP8_KV_DTYPE)
    query = torch.full((1, 2, 32), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    out = paged_decode_attention(query, layout.k_cache, layout.v_cache, layout.block_table,
                                 torch.tensor([9], dtype=torch.int32, device=DEVICE), 1.0,
                                 block_size=8, num_splits=1,
                                 tile=DecodeTile(64, 4, 2, widen_to_f16=True))
    assert torch.isnan(out.float()).all()


def test_decode_tiles_are_checked() -> None:
    layout = make_layout([9], block_size=8, num_kv_heads=1, head_dim=32, dtype=torch.bfloat16)
    args = (torch.zeros(1, 1, 32, device=DEVICE, dtype=torch.bfloat16), layout.k_cache,
            layout.v_cache, layout.block_table,
            torch.tensor([9], dtype=torch.int32, device=DEVICE), 1.0)
    with pytest.raises(ValueError, match=r"needs a torch\.float8_e4m3fn cache"):
        paged_decode_attention(*args, block_size=8, num_splits=1,
                               tile=DecodeTile(64, 4, 2, widen_to_f16=True))
    with pytest.raises(ValueError, match="invalid decode tile"):
        paged_decode_attention(*args, block_size=8, num_splits=1, tile=DecodeTile(48, 4, 2))


def test_store_kv_rounds_into_an_fp8_cache() -> None:
    generator = torch.Generator().manual_seed(5)
    key, value = (torch.randn(3, 2, 32, generator=generator).mul(40).to(DEVICE)
                  for _ in range(2))
    cache = torch.zeros(2, 16, 2, 32, dtype=FP8_KV_DTYPE, device=DEVICE)
    slots = torch.tensor([4, 0, 9], device=DEVICE)

    store_kv(key, value, cache[0], cache[1], slots)

    assert torch.equal(cache[0][slots].float(), key.to(FP8_KV_DTYPE).float())
    assert torch.equal(cache[1][slots].float(), value.to(FP8_KV_DTYPE).float())
    assert cache[0][1].float().abs().sum() == 0


def test_a_cache_of_another_dtype_is_refused() -> None:
    layout = make_layout([9], block_size=8, num_kv_heads=1, head_dim=32, dtype=torch.float16)
    with pytest.raises(ValueError, match="neither the query's"):
        paged_decode_attention(torch.zeros(1, 1, 32, device=DEVICE), layout.k_cache,
                               layout.v_cache, layout.block_table,
                               torch.tensor([9], dtype=torch.int32, device=DEVICE), 1.0,
                               block_size=8, num_splits=1)


@triton.jit
def _widen_kernel(float8_ptr, float32_ptr, bfloat16_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    value = tl.load(float8_ptr + offsets)
    tl.store(float32_ptr + offsets, value.to(tl.float32))
    tl.store(bfloat16_ptr + offsets, value.to(tl.bfloat16))


def test_float8_widens_exactly_nan_included() -> None:
    # The NaN that marks a slot no kernel may read stays NaN in an fp8 cache too (Triton 3.6's
    # interpreter made it 480 before `mend_interpreter`).
    values = torch.tensor([448.0, float("nan"), -32.0, 0.015625, -0.0, 1.5, 240.0, 3.0])
    float8 = values.to(FP8_KV_DTYPE).to(DEVICE)
    float32 = torch.empty(8, device=DEVICE)
    bfloat16 = torch.empty(8, dtype=torch.bfloat16, device=DEVICE)
    _widen_kernel[(1,)](float8, float32, bfloat16, N=8)
    expected = float8.cpu().float()
    torch.testing.assert_close(float32.cpu(), expected, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(bfloat16.cpu().float(), expected, rtol=0, atol=0,
                               equal_nan=True)


@triton.jit
def _wrap_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    x = tl.load(x_ptr + offsets)
    tl.store(out_ptr + offsets, x * 4 + 1)


def test_int32_products_wrap_as_compiled_kernels_do() -> None:
    """Overflowing 32-bit products wrap; under the interpreter, which skips the overflow
    checks its `device_assert` would drop (`mend_interpreter`), as well."""
    x = torch.tensor([2**30, -(2**30) - 1, 7, 2**29], dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(x)
    _wrap_kernel[(1,)](x, out, N=4)
    expected = (x.cpu().numpy().astype(np.int64) * 4 + 1).astype(np.int32)  # two's complement
    assert out.cpu().tolist() == expected.tolist() == [1, -3, 29, -(2**31) + 1]
    if DEVICE == "cpu":
        from triton.runtime import interpreter

        for builder in (interpreter.interpreter_builder, interpreter.InterpreterBuilder()):
            assert builder.options.sanitize_overflow is builder.options.debug is False
