"""Triton kernels for attention over the paged KV cache, reading K/V through the block table.

Layout of one layer's cache: `[2, num_blocks * block_size, num_kv_heads, head_dim]` (K then V);
the kernels take `k_cache = kv_cache[0]` and `v_cache = kv_cache[1]` (`[num_slots, num_kv_heads,
head_dim]`, any strides) and find token `p` of a sequence in slot
`block_table[p // block_size] * block_size + p % block_size`. Nothing is gathered into a
workspace: every key tile loads its block ids from the block table and its rows from the cache.
The step's K/V must already be in the cache when a kernel runs.

Both kernels put the query heads that share one KV head (GQA) into the M dimension of one
program, padded to a power of two and masked, so each K/V tile is loaded once per KV head.
Softmax runs online in float32, in base 2 (`scale * log2(e)` is folded into the scores).
Neither wrapper reads device values on the host: both can be captured in a CUDA graph.

Arguments that change from step to step are never compile-time values: Triton compiles a
kernel again for every new value of a `tl.constexpr` and for every new divisibility class of
a specialised int, and a compile of the prefill kernel stalls a live step by most of a second.
So the block table's row stride (its width follows the step's longest sequence) and the
prefill's sequence count are not specialised, and the decode split count is a runtime int;
what stays compile-time (head shapes, block size, tiles, whether the decode splits at all) is
fixed for a model.

Under Triton's interpreter (`TRITON_INTERPRET=1`: CPU tensors, for tests) importing this module
first mends three gaps of Triton 3.6's interpreter (`engine.model.triton_interpreter`);
compiled kernels are untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from engine.model.triton_interpreter import mend_interpreter

if triton.knobs.runtime.interpret:
    mend_interpreter()

SUPPORTED_HEAD_DIMS = (32, 64, 128)
MIN_BLOCK_SIZE = 8
# A cache of this dtype (kv_cache_dtype fp8) is read and written with a scale of 1: stores
# round the step's K/V to it, the attention kernels widen each tile to the query's dtype (or,
# in decode, to float16: `DecodeTile.widen_to_f16`).
FP8_KV_DTYPE = torch.float8_e4m3fn

_LOG2_E = 1.4426950408889634
_NO_WINDOW = 1 << 30  # a window no sequence reaches: the kernels then mask causally only
_NUM_SMS = 132  # H100 SXM; the split heuristics aim to fill them
_PROGRAMS_PER_SM = 2  # what the split heuristics aim at
_MAX_SPLITS = 64  # the reduction holds all splits of a head in registers
_MAX_GRID = 2**31 - 1  # programs on a grid's first axis (CUDA's limit)
_MIN_BLOCKS_PER_SPLIT = 4
MIN_PREFILL_KEYS_PER_SPLIT = 512  # eight key tiles of 64
# The float32 partials of a step's split prefill (max, sum and output of every query row, head
# and split) take at most this many bytes; the rule gives fewer splits rather than more.
PREFILL_PARTIALS_BYTES = 32 * 2**20
_DECODE_BLOCK_N = 64  # key positions per tile of the default decode tile
_MIN_DOT_M = 16  # tl.dot needs M >= 16 on tensor cores
_PREFILL_ROWS = 64  # rows of the untuned prefill tile in 16-bit (`_prefill_config`)


class _TileConfig(NamedTuple):
    block_m: int  # rows per program (prefill: query tokens x heads of a group)
    block_n: int  # key positions per tile
    num_warps: int
    num_stages: int


def supports(head_dim: int, block_size: int) -> bool:
    """Whether these kernels cover `head_dim` (32, 64 or 128) and `block_size` (tokens per KV
    block: a power of two, at least 8)."""
    return head_dim in SUPPORTED_HEAD_DIMS and _is_power_of_two(block_size) and (
        block_size >= MIN_BLOCK_SIZE)


def default_num_splits(max_seq_len: int, block_size: int, batch: int, num_kv_heads: int) -> int:
    """Splits per sequence for `paged_decode_attention`: a power of two, at least 1.

    A host-side choice from shapes only (pass the longest length a captured graph may see):
    enough (sequence, KV head, split) programs to fill an H100's 132 SMs twice over, but no
    split shorter than 4 blocks (nor than one 64-position decode tile), whose fixed cost the
    reduction would not repay, and at most 64 splits. Long contexts and small batches get
    the most splits.
    """
    programs = max(batch, 1) * max(num_kv_heads, 1)
    wanted = -(-_PROGRAMS_PER_SM * _NUM_SMS // programs)
    min_split_len = max(_MIN_BLOCKS_PER_SPLIT * block_size, _DECODE_BLOCK_N)
    splits = min(wanted, max_seq_len // min_split_len, _MAX_SPLITS)
    return _floor_power_of_two(max(splits, 1))


def default_prefill_splits(query_lens: Sequence[int], max_seq_len: int, num_heads: int,
                           num_kv_heads: int, head_dim: int,
                           sliding_window: int | None = None) -> int:
    """Key splits per program for `paged_prefill_attention`, a host-side choice from the
    step's query lengths and its longest sequence (cached context and queries, in tokens).

    A step of short chunks over long cached contexts (an agent's next turn) launches fewer
    programs than an H100 has SMs, each walking every key tile of its context; splitting
    each program's keys aims, as decode does, at two programs an SM. Programs are counted
    approximately: in 64-row query tiles (the 16-bit rule's; float32 tiles have 32 rows, the
    autotuner may take 128), and without the step's decodes, which another kernel attends.
    No split covers fewer than 512 of the keys a program can reach (the longest sequence, or
    its query tile's window), whose fixed cost the reduction would not repay, and the
    partials stay within `PREFILL_PARTIALS_BYTES`. 1 for a step that fills the card (every
    full-budget prompt of Llama-3.1-8B's shapes).
    """
    block_q = split_rule_query_tile(num_heads, num_kv_heads)
    programs = num_kv_heads * sum(-(-query_len // block_q) for query_len in query_lens)
    if programs == 0 or programs >= _NUM_SMS:
        return 1
    keys = max_seq_len
    if sliding_window is not None:  # a program's: its first query's window to its last query
        keys = min(keys, sliding_window + min(max(query_lens), block_q) - 1)
    split_bytes = _partials_bytes_per_split(sum(query_lens), num_heads, head_dim)
    splits = min(-(-_PROGRAMS_PER_SM * _NUM_SMS // programs),
                 keys // MIN_PREFILL_KEYS_PER_SPLIT, PREFILL_PARTIALS_BYTES // split_bytes,
                 _MAX_SPLITS)
    return max(splits, 1)


def split_rule_query_tile(num_heads: int, num_kv_heads: int) -> int:
    """Query tokens a program holds as `default_prefill_splits` counts programs: a 64-row
    tile over the padded group of query heads a KV head serves."""
    return max(_PREFILL_ROWS // next_power_of_two(num_heads // num_kv_heads), 1)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Writes the step's K/V rows into the cache: token `t` of `key` and `value` [tokens,
    num_kv_heads, head_dim] (any strides with a contiguous last dimension: views into a fused
    projection) at slot `slots[t]` (int64 [tokens]) of `k_cache` and `v_cache`, rounded to
    their dtype. One kernel for both, one program per token, in place of two index copies."""
    tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must match, "
                         "with a contiguous head dimension")
    if slots.shape != (tokens,):
        raise ValueError(f"slots has shape {tuple(slots.shape)}, expected ({tokens},)")
    if tokens == 0:
        return
    _store_kv_kernel[(tokens,)](
        key, value, k_cache, v_cache, slots, *key.stride()[:2], *value.stride()[:2],
        *k_cache.stride()[:2], *v_cache.stride()[:2], num_kv_heads, head_dim,
        BLOCK_H=next_power_of_two(num_kv_heads), BLOCK_D=next_power_of_two(head_dim))


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    block_size: int,
    num_splits: int,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    tile: DecodeTile | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged K/V (split-K flash decoding).

    Called once per layer for a step's decodes, after their K/V were written to the cache.

    - `query` [B, num_heads, head_dim] (float32, float16 or bfloat16): the token at position
      `seq_lens[b] - 1` of sequence `b`; heads `h * G ... h * G + G - 1` share KV head `h`
      (`G = num_heads // num_kv_heads`).
    - `k_cache`, `v_cache` [num_slots, num_kv_heads, head_dim], the query's dtype or
      `FP8_KV_DTYPE`.
    - `block_table` int32 [B, max_blocks]: each row's block ids, padded on the right with
      any valid id (never read past the sequence).
    - `seq_lens` int32 [B]: tokens in the cache, the new one included; 0 marks a padding row
      (CUDA-graph padding), which reads no block and gets zeros.
    - `scale`: the factor on the scores (usually `head_dim ** -0.5`).
    - `num_splits`: a fixed host int from 1 to 64 (`default_num_splits`); split `s` of a
      sequence covers the `s`-th share of its key tiles (those in the window), computed in
      the kernel from `seq_lens`, so splits past the end of a short sequence do nothing.
    - `sliding_window`: when given, the query attends only its last `sliding_window`
      positions (itself included).
    - `out`: optional [B, num_heads, head_dim] output, the query's dtype.
    - `tile`: the kernel's tile (None: `decode_tile` of the cache's dtype); the tile sweep of
      `eval/gpu/decode_tiles.py` passes others.

    One program per sequence, KV head and split, in a flat grid whose order puts a
    sequence's work together, in the order of the sequences (`_decode_program`): as the
    runner lays decodes out longest context first, the costliest programs go first rather
    than a head's longest sequences last. Each program holds the group's query heads
    (padded to a power of two, at least 16 for `tl.dot`) and walks its split in tiles of
    `tile.block_n` key positions, writing float32 partials (max, sum of exponentials,
    unnormalised output) that a second kernel, one program per (sequence, head), combines.
    With `num_splits == 1` the first kernel writes the output itself. Returns `out` (or a new
    tensor) [B, num_heads, head_dim].
    """
    num_kv_heads = _check_inputs(query, k_cache, v_cache, block_size)
    batch, num_heads, head_dim = query.shape
    _check_index("block_table", block_table, 2)
    _check_index("seq_lens", seq_lens, 1)
    if not 1 <= num_splits <= _MAX_SPLITS:
        raise ValueError(f"num_splits must be from 1 to {_MAX_SPLITS}, got {num_splits}")
    out = _output(query, out)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    tile = decode_tile(k_cache.dtype) if tile is None else tile
    _check_decode_tile(tile, k_cache.dtype)
    part_max, part_sum, part_acc = _partials(out, num_splits)
    _decode_split_kernel[(batch * num_kv_heads * num_splits,)](
        query, k_cache, v_cache, block_table, seq_lens, out, part_max, part_sum, part_acc,
        scale * _LOG2_E, _window(sliding_window), num_heads, num_splits,
        *query.stride(), *k_cache.stride(), *v_cache.stride(), block_table.stride(0),
        *out.stride(),
        GROUP=group, GROUP_PAD=max(next_power_of_two(group), _MIN_DOT_M), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=tile.block_n, SPLIT=num_splits > 1,
        DOT_PRECISION=_dot_precision(query.dtype),
        WIDEN_TO_F16=tile.widen_to_f16 and query.dtype != torch.float32,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            part_max, part_sum, part_acc, out, *out.stride(), num_splits,
            MAX_SPLITS=_MAX_SPLITS, HEAD_DIM=head_dim, num_warps=4,
        )
    return out


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    block_size: int,
    max_query_len: int,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int = 1,
) -> torch.Tensor:
    """Causal attention of multi-token queries (prefills and chunks over a cached prefix).

    Called once per layer for a step's prefills, after their K/V were written to the cache.

    - `query` [T, num_heads, head_dim] (float32, float16 or bfloat16): the flattened queries
      of S sequences; sequence `i` owns rows `query_start_loc[i] : query_start_loc[i + 1]`,
      its last `query_len_i` positions (`seq_lens[i] - query_len_i ... seq_lens[i] - 1`).
    - `k_cache`, `v_cache` [num_slots, num_kv_heads, head_dim], the query's dtype or
      `FP8_KV_DTYPE`.
    - `block_table` int32 [S, max_blocks]; `query_start_loc` int32 [S + 1];
      `seq_lens` int32 [S]: all tokens of each sequence, cached context and this step's.
    - `scale`: the factor on the scores; `max_query_len`: a host int bounding every
      `query_len_i` (it sizes the grid).
    - `sliding_window`: when given, a query at position q attends keys in
      `(q - sliding_window, q]`; otherwise all keys `<= q` (bottom-right aligned causal mask).
    - `out`: optional [T, num_heads, head_dim] output, the query's dtype.
    - `num_splits`: a host int from 1 to 64 (`default_prefill_splits`); split `s` of a
      program covers the `s`-th share of the key tiles its queries reach. With more than
      one, every program writes float32 partials as decode's splits do, and a second
      kernel (decode's reduction under a name of its own) combines them, one program per
      query row and head.

    Programs: one per query tile, KV head, key split and sequence (`_launch_prefill`). A program's
    BLOCK_M rows (64; 32 in float32; for 16-bit on CUDA, with at most 128 query heads a KV
    head, 64 or 128 as measured on the device: `_TUNED_PREFILL_TILES`) are BLOCK_Q query
    tokens times the G query heads of one KV head (G padded to a power of two), so a K/V tile
    serves the whole group; it walks only the key tiles (64 positions; 32 in float32) its
    causal and window range reaches, with `tl.dot` for QK^T and PV. Programs before a
    shorter sequence's first query do nothing. Returns `out` (or a new tensor) [T,
    num_heads, head_dim].
    """
    num_kv_heads = _check_inputs(query, k_cache, v_cache, block_size)
    num_tokens, num_heads, head_dim = query.shape
    _check_index("block_table", block_table, 2)
    _check_index("query_start_loc", query_start_loc, 1)
    _check_index("seq_lens", seq_lens, 1)
    if not 1 <= num_splits <= _MAX_SPLITS:
        raise ValueError(f"num_splits must be from 1 to {_MAX_SPLITS}, got {num_splits}")
    out = _output(query, out)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len < 1:
        return out
    group_pad = next_power_of_two(num_heads // num_kv_heads)
    if (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
            and group_pad <= max(_TUNED_PREFILL_BLOCK_M)):
        tile = None  # the autotuner's
    else:
        tile = _prefill_config(group_pad, head_dim, query.dtype)
    _launch_prefill(query, k_cache, v_cache, block_table, query_start_loc, seq_lens, out,
                    scale, block_size=block_size, max_query_len=max_query_len,
                    sliding_window=sliding_window, tile=tile, num_splits=num_splits)
    return out


def _launch_prefill(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    out: torch.Tensor, scale: float, *, block_size: int, max_query_len: int,
    sliding_window: int | None, tile: _TileConfig | None, num_splits: int = 1,
) -> None:
    """Enqueues the prefill kernel over checked inputs: with `tile` (rows, keys, warps,
    stages) as given, or, None, with the autotuner's tile (`_tuned_prefill_kernel`, tuned
    apart with and without splits); with `num_splits` > 1, then the reduction.

    The grid is flat, `cdiv(max_query_len, BLOCK_Q)` rounds of one program per KV head, key
    split and sequence, each round one query tile further back from every sequence's last
    (`_prefill_program`). ValueError if it would pass Triton's limit on the grid."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    group_pad = next_power_of_two(group)
    part_max, part_sum, part_acc = _partials(out, num_splits)
    args = (query, k_cache, v_cache, block_table, query_start_loc, seq_lens, out,
            part_max, part_sum, part_acc, scale * _LOG2_E, _window(sliding_window), num_seqs,
            num_splits, *query.stride(), *k_cache.stride(), *v_cache.stride(),
            block_table.stride(0), *out.stride())
    shapes = {"NUM_KV_HEADS": num_kv_heads, "GROUP": group, "GROUP_PAD": group_pad,
              "HEAD_DIM": head_dim, "BLOCK_SIZE": block_size,
              "DOT_PRECISION": _dot_precision(query.dtype), "SPLIT": num_splits > 1}

    def grid(block_q: int) -> tuple[int]:
        return (triton.cdiv(max_query_len, block_q) * num_kv_heads * num_splits * num_seqs,)

    if grid(1)[0] > _MAX_GRID:  # the most programs any tile launches (BLOCK_Q 1)
        raise ValueError(f"a prefill of {num_seqs} sequences, {max_query_len} query tokens, "
                         f"{num_kv_heads} KV heads and {num_splits} key splits needs more "
                         f"than {_MAX_GRID} programs")

    if tile is None:
        _tuned_prefill_kernel[lambda meta: grid(meta["BLOCK_Q"])](*args, **shapes)
    else:
        block_q = tile.block_m // group_pad
        _prefill_kernel[grid(block_q)](
            *args, **shapes, BLOCK_Q=block_q, BLOCK_N=tile.block_n, num_warps=tile.num_warps,
            num_stages=tile.num_stages)
    if num_splits > 1:
        _prefill_reduce_kernel[(num_tokens, num_heads)](
            part_max, part_sum, part_acc, out, *out.stride(), num_splits,
            MAX_SPLITS=_MAX_SPLITS, HEAD_DIM=head_dim, num_warps=4,
        )


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
                     key_token_stride, key_head_stride, value_token_stride, value_head_stride,
                     k_slot_stride, k_head_stride, v_slot_stride, v_head_stride, num_kv_heads,
                     head_dim, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    key = tl.load(key_ptr + token * key_token_stride + heads * key_head_stride + dims,
                  mask=mask)
    tl.store(k_cache_ptr + slot * k_slot_stride + heads * k_head_stride + dims,
             key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    value = tl.load(value_ptr + token * value_token_stride + heads * value_head_stride + dims,
                    mask=mask)
    tl.store(v_cache_ptr + slot * v_slot_stride + heads * v_head_stride + dims,
             value.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _decode_split_kernel(
    query_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, out_ptr,
    part_max_ptr, part_sum_ptr, part_acc_ptr,
    qk_scale, window, num_heads, num_splits,
    stride_qb, stride_qh, stride_qd,
    stride_ks, stride_kh, stride_kd,
    stride_vs, stride_vh, stride_vd,
    stride_bt,
    stride_ob, stride_oh, stride_od,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WIDEN_TO_F16: tl.constexpr,
):
    kv_head, split, seq = _decode_program(tl.program_id(0), num_heads // GROUP, num_splits)
    seq_len = tl.load(seq_lens_ptr + seq)
    first_key = tl.maximum(seq_len - window, 0)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    first_tile = first_key // BLOCK_N
    tiles_per_split = tl.cdiv(num_tiles - first_tile, num_splits)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    heads = tl.arange(0, GROUP_PAD)
    head_ok = heads < GROUP
    q_heads = kv_head * GROUP + heads
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        query_ptr + seq * stride_qb + q_heads[:, None] * stride_qh + dims[None, :] * stride_qd,
        mask=head_ok[:, None], other=0.0,
    )
    if WIDEN_TO_F16:
        # float8 widens to float16 in one instruction per pair of values; bfloat16 takes
        # one more per value (sm_90's PTX). The scale goes into the query first, which keeps
        # it in float16's range.
        q = tl.clamp(q.to(tl.float32) * qk_scale, -65504.0, 65504.0,
                     propagate_nan=tl.PropagateNan.ALL).to(tl.float16)
        score_scale = 1.0
    else:
        score_scale = qk_scale
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    block_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    offs_n = tl.arange(0, BLOCK_N)
    for tile in range(tile_lo, tile_hi):
        pos = tile * BLOCK_N + offs_n
        key_ok = (pos >= first_key) & (pos < seq_len)
        block_ids = tl.load(block_row + pos // BLOCK_SIZE, mask=key_ok, other=0)
        slots = block_ids.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        k = tl.load(k_base + slots[None, :] * stride_ks + dims[:, None] * stride_kd,
                    mask=key_ok[None, :], other=0.0).to(q.dtype)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * score_scale
        # Every tile holds at least one key in range, so the running max stays finite.
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slots[:, None] * stride_vs + dims[None, :] * stride_vd,
                    mask=key_ok[:, None], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if not SPLIT:
        result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + seq * stride_ob + q_heads[:, None] * stride_oh + dims[None, :] * stride_od,
            result.to(out_ptr.dtype.element_ty), mask=head_ok[:, None],
        )
    else:
        part = (seq * num_heads + q_heads) * num_splits + split
        tl.store(part_max_ptr + part, m_i, mask=head_ok)
        tl.store(part_sum_ptr + part, l_i, mask=head_ok)
        tl.store(part_acc_ptr + part.to(tl.int64)[:, None] * HEAD_DIM + dims[None, :], acc,
                 mask=head_ok[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    part_max_ptr, part_sum_ptr, part_acc_ptr, out_ptr,
    stride_ob, stride_oh, stride_od, num_splits,
    MAX_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    _combine_splits(part_max_ptr, part_sum_ptr, part_acc_ptr, out_ptr, stride_ob, stride_oh,
                    stride_od, num_splits, MAX_SPLITS, HEAD_DIM)


@triton.jit(do_not_specialize=["num_splits"])
def _prefill_reduce_kernel(
    part_max_ptr, part_sum_ptr, part_acc_ptr, out_ptr,
    stride_ot, stride_oh, stride_od, num_splits,
    MAX_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    _combine_splits(part_max_ptr, part_sum_ptr, part_acc_ptr, out_ptr, stride_ot, stride_oh,
                    stride_od, num_splits, MAX_SPLITS, HEAD_DIM)


@triton.jit
def _combine_splits(part_max_ptr, part_sum_ptr, part_acc_ptr, out_ptr, stride_or, stride_oh,
                    stride_od, num_splits, MAX_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Output row `program_id(0)`, head `program_id(1)`, from the float32 partials of its
    splits ([rows, heads, splits (, head_dim)]); two kernels call it so that a profile tells
    decode's reduction from prefill's."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, MAX_SPLITS)
    split_ok = splits < num_splits
    part = (row * tl.num_programs(1) + head) * num_splits + splits
    maxes = tl.load(part_max_ptr + part, mask=split_ok, other=float("-inf"))
    sums = tl.load(part_sum_ptr + part, mask=split_ok, other=0.0)
    top = tl.max(maxes, 0)
    # A padding row has no key in any split: keep its weights at 0 rather than exp(nan).
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp2(maxes - top)
    denominator = tl.sum(sums * weights, 0)
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.load(part_acc_ptr + part.to(tl.int64)[:, None] * HEAD_DIM + dims[None, :],
                  mask=split_ok[:, None], other=0.0)
    numerator = tl.sum(acc * weights[:, None], 0)
    result = numerator / tl.where(denominator > 0, denominator, 1.0)
    tl.store(out_ptr + row * stride_or + head * stride_oh + dims * stride_od,
             result.to(out_ptr.dtype.element_ty))


@triton.jit
def _prefill_key_tile(q, acc, m_i, l_i, tile, key_hi, q_pos, window, qk_scale, block_row,
                      k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
                      HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr):
    """One key tile of the prefill kernel's online softmax: `(acc, m_i, l_i)` updated. Not
    `MASKED`: every query row sees every key of the tile, so no bound or mask is applied."""
    dims = tl.arange(0, HEAD_DIM)
    pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    key_ok = pos < key_hi
    if MASKED:
        block_ids = tl.load(block_row + pos // BLOCK_SIZE, mask=key_ok, other=0)
    else:
        block_ids = tl.load(block_row + pos // BLOCK_SIZE)
    slots = block_ids.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
    k_ptrs = k_base + slots[None, :] * stride_ks + dims[:, None] * stride_kd
    if MASKED:
        k = tl.load(k_ptrs, mask=key_ok[None, :], other=0.0).to(q.dtype)
    else:
        k = tl.load(k_ptrs).to(q.dtype)
    scores = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        allowed = (key_ok[None, :] & (pos[None, :] <= q_pos[:, None])
                   & (pos[None, :] > q_pos[:, None] - window))
        scores = tl.where(allowed, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    # A row can see no key of a tile (its window starts later): shift by 0, not by -inf.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(scores - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v_ptrs = v_base + slots[:, None] * stride_vs + dims[None, :] * stride_vd
    if MASKED:
        v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0).to(q.dtype)
    else:
        v = tl.load(v_ptrs).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _prefill_program(program, query_start_loc_ptr, num_seqs, num_splits,
                     NUM_KV_HEADS: tl.constexpr, BLOCK_Q: tl.constexpr):
    """What prefill program `program` computes: `(kv_head, split, seq, q_tile, query_start,
    query_len)`. KV heads vary fastest, then key splits, then sequences, then query tiles
    counted back from each sequence's last, so the device dispatches every sequence's last
    tiles (under a causal mask, those that walk the most key tiles) first and its cheap first
    tiles last. A negative `q_tile` lies before a shorter sequence's first query: that
    program does nothing."""
    kv_head = program % NUM_KV_HEADS
    split = program // NUM_KV_HEADS % num_splits
    seq = program // (NUM_KV_HEADS * num_splits) % num_seqs
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    q_tile = tl.cdiv(query_len, BLOCK_Q) - 1 - program // (NUM_KV_HEADS * num_splits * num_seqs)
    return kv_head, split, seq, q_tile, query_start, query_len


@triton.jit
def _decode_program(program, num_kv_heads, num_splits):
    """`(kv_head, split, seq)` of decode program `program`: KV heads vary fastest, then
    splits, then sequences, so all the work of a sequence is dispatched together and in the
    runner's order of sequences (longest context first)."""
    return (program % num_kv_heads, program // num_kv_heads % num_splits,
            program // (num_kv_heads * num_splits))


@triton.jit(do_not_specialize=["stride_bt", "num_seqs", "num_splits"])
def _prefill_kernel(
    query_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, query_start_loc_ptr, seq_lens_ptr,
    out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr,
    qk_scale, window, num_seqs, num_splits,
    stride_qt, stride_qh, stride_qd,
    stride_ks, stride_kh, stride_kd,
    stride_vs, stride_vh, stride_vd,
    stride_bt,
    stride_ot, stride_oh, stride_od,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr,
):
    # Unsplit, the split count is the constant 1: the program's decomposition and its key
    # runs compile to the code of a kernel without splits.
    kv_head, split, seq, q_tile, query_start, query_len = _prefill_program(
        tl.program_id(0), query_start_loc_ptr, num_seqs, num_splits if SPLIT else 1,
        NUM_KV_HEADS, BLOCK_Q)
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    token = q_tile * BLOCK_Q + rows // GROUP_PAD
    heads = rows % GROUP_PAD
    row_ok = (token >= 0) & (token < query_len) & (heads < GROUP)
    q_pos = context_len + token
    q_rows = (query_start + token).to(tl.int64)
    q_heads = kv_head * GROUP + heads
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        query_ptr + q_rows[:, None] * stride_qt + q_heads[:, None] * stride_qh
        + dims[None, :] * stride_qd,
        mask=row_ok[:, None], other=0.0,
    )

    # Key range of this tile's queries; empty for a tile before the sequence's queries.
    first_q_pos = context_len + q_tile * BLOCK_Q
    last_q_pos = context_len + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, query_len) - 1
    key_lo = tl.maximum(first_q_pos - window + 1, 0)
    key_hi = tl.minimum(first_q_pos + BLOCK_Q, seq_len)
    key_hi = tl.where(q_tile >= 0, key_hi, 0)
    # Key tiles [lo, hi) in three runs: the middle one's tiles are seen whole by every query
    # row (inside the last query's window, at or before the first query), so they skip the
    # mask; the tiles before it (the window's edge) and after it (the causal diagonal) do not.
    lo = key_lo // BLOCK_N
    hi = tl.cdiv(key_hi, BLOCK_N)
    first_whole = tl.cdiv(tl.maximum(last_q_pos - window + 1, 0), BLOCK_N)
    mid_lo = tl.minimum(tl.maximum(first_whole, lo), hi)
    mid_hi = tl.minimum(tl.maximum((first_q_pos + 1) // BLOCK_N, mid_lo), hi)
    # Split, this program walks the `split`-th share of [lo, hi) only: each run cut to it.
    if SPLIT:
        tiles_per_split = tl.cdiv(tl.maximum(hi - lo, 0), num_splits)
        split_lo = lo + split * tiles_per_split
        split_hi = tl.minimum(split_lo + tiles_per_split, hi)
        edge_hi = tl.minimum(mid_lo, split_hi)
        whole_lo = tl.maximum(mid_lo, split_lo)
        whole_hi = tl.minimum(mid_hi, split_hi)
        diagonal_lo = tl.maximum(mid_hi, split_lo)
    else:
        split_lo, edge_hi, whole_lo, whole_hi, diagonal_lo, split_hi = (
            lo, mid_lo, mid_lo, mid_hi, mid_hi, hi)

    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM], tl.float32)
    block_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    for tile in range(split_lo, edge_hi):
        acc, m_i, l_i = _prefill_key_tile(
            q, acc, m_i, l_i, tile, key_hi, q_pos, window, qk_scale, block_row, k_base, v_base,
            stride_ks, stride_kd, stride_vs, stride_vd, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
            DOT_PRECISION, True)
    for tile in range(whole_lo, whole_hi):
        acc, m_i, l_i = _prefill_key_tile(
            q, acc, m_i, l_i, tile, key_hi, q_pos, window, qk_scale, block_row, k_base, v_base,
            stride_ks, stride_kd, stride_vs, stride_vd, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
            DOT_PRECISION, False)
    for tile in range(diagonal_lo, split_hi):
        acc, m_i, l_i = _prefill_key_tile(
            q, acc, m_i, l_i, tile, key_hi, q_pos, window, qk_scale, block_row, k_base, v_base,
            stride_ks, stride_kd, stride_vs, stride_vd, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
            DOT_PRECISION, True)

    if not SPLIT:
        result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + q_rows[:, None] * stride_ot + q_heads[:, None] * stride_oh
            + dims[None, :] * stride_od,
            result.to(out_ptr.dtype.element_ty), mask=row_ok[:, None],
        )
    else:
        # `_combine_splits`' layout, [query rows, heads, splits (, head_dim)].
        part = (q_rows * (NUM_KV_HEADS * GROUP) + q_heads) * num_splits + split
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc,
                 mask=row_ok[:, None])


# Prefill in 16-bit on CUDA: the tile shape is measured on the device at the first prefill of
# each head dim, group and block size (the runner's full-budget start-up forward, so not on
# whatever prompt comes first) among these (rows of queries x padded group, keys a tile,
# warps, stages): those that compile for sm_90 at head dims 64 and 128 without register
# spills, the untuned rule's first. With the strides Triton sees at run time (divisible by
# 16), the K/V loads through the block table compile to asynchronous copies: two stages
# overlap a tile's K/V loads with the tile before; three also prefetch the block table's
# entries (four compile to the same code as three).
_TUNED_PREFILL_TILES = ((64, 64, 8, 2), (64, 64, 4, 2), (128, 64, 8, 2),
                        (64, 64, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3))


def _prune_prefill_configs(configs: list[triton.Config], named_args: dict[str, Any],
                           **kwargs: Any) -> list[triton.Config]:
    """The configs of `_TUNED_PREFILL_TILES` for this group (`BLOCK_Q` x `GROUP_PAD` rows)."""
    group_pad = kwargs["GROUP_PAD"]
    return [config for config in configs
            if (config.kwargs["BLOCK_Q"] * group_pad, config.kwargs["BLOCK_N"],
                config.num_warps, config.num_stages) in _TUNED_PREFILL_TILES]


_TUNED_PREFILL_BLOCK_M = tuple(tile[0] for tile in _TUNED_PREFILL_TILES)
_tuned_prefill_kernel = triton.autotune(
    configs=[triton.Config({"BLOCK_Q": block_q, "BLOCK_N": block_n}, num_warps=warps,
                           num_stages=stages)
             for block_q in (1, 2, 4, 8, 16, 32, 64, 128)
             for block_n, warps, stages in dict.fromkeys(tile[1:] for tile in
                                                         _TUNED_PREFILL_TILES)],
    key=["HEAD_DIM", "GROUP_PAD", "BLOCK_SIZE", "SPLIT"],
    prune_configs_by={"early_config_prune": _prune_prefill_configs},
)(_prefill_kernel)


class DecodeTile(NamedTuple):
    """The decode kernel's tile: key positions a tile (a power of two, at least 16), warps,
    pipeline stages, and whether a float8 cache is widened to float16 (the query scaled into
    float16 too) rather than to the query's dtype, for a 16-bit query (a float32 query keeps
    float32, whose precision float16 would lose)."""

    block_n: int
    num_warps: int
    num_stages: int
    widen_to_f16: bool = False


# What every cache dtype runs unless the table below says otherwise.
_DEFAULT_DECODE_TILE = DecodeTile(_DECODE_BLOCK_N, 4, 2)
# Chosen by eval/gpu/decode_tiles.py on an H100 (docs/decisions/0022-decode-tiles.md), where a
# tile beat the old one by 2 % or more (geometric mean over decode batch 128 x 1k and 32 x
# 8k): over an fp8 cache, 128-key tiles widened to float16 took 0.876x its time (0.86x at 32
# x 8k); no bf16 tile did (the best, 0.998x, is left out).
_DECODE_TILES: dict[torch.dtype, DecodeTile] = {
    FP8_KV_DTYPE: DecodeTile(128, 4, 3, widen_to_f16=True),
}


def decode_tile(cache_dtype: torch.dtype) -> DecodeTile:
    """The tile `paged_decode_attention` uses over a cache of `cache_dtype`."""
    return _DECODE_TILES.get(cache_dtype, _DEFAULT_DECODE_TILE)


def decode_tile_candidates(cache_dtype: torch.dtype) -> list[DecodeTile]:
    """The tiles `eval/gpu/decode_tiles.py` measures over a cache of `cache_dtype`."""
    widen = (False, True) if cache_dtype == FP8_KV_DTYPE else (False,)
    return [DecodeTile(block_n, warps, stages, widen_to_f16)
            for widen_to_f16 in widen for block_n in (64, 128) for warps in (4, 8)
            for stages in (2, 3)]


def _check_decode_tile(tile: DecodeTile, cache_dtype: torch.dtype) -> None:
    if not (_is_power_of_two(tile.block_n) and tile.block_n >= _MIN_DOT_M
            and tile.num_warps in (1, 2, 4, 8, 16) and tile.num_stages >= 1):
        raise ValueError(f"invalid decode tile {tile}")
    if tile.widen_to_f16 and cache_dtype != FP8_KV_DTYPE:
        raise ValueError(f"widen_to_f16 needs a {FP8_KV_DTYPE} cache, not {cache_dtype}")


def _partials(out: torch.Tensor, num_splits: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The float32 partials of a split kernel writing `out` [rows, heads, head_dim]: max and
    sum [rows, heads, splits], unnormalised output [rows, heads, splits, head_dim]. Unsplit,
    `out` three times (unused: the kernel normalises in place)."""
    if num_splits == 1:
        return out, out, out
    rows, num_heads, head_dim = out.shape
    part_max = torch.empty((rows, num_heads, num_splits), dtype=torch.float32,
                           device=out.device)
    part_acc = torch.empty((rows, num_heads, num_splits, head_dim), dtype=torch.float32,
                           device=out.device)
    return part_max, torch.empty_like(part_max), part_acc


def _partials_bytes_per_split(rows: int, num_heads: int, head_dim: int) -> int:
    """Bytes of `_partials` a split adds for `rows` query rows (float32 max, sum, output)."""
    return rows * num_heads * (head_dim + 2) * 4


def _prefill_config(group_pad: int, head_dim: int, dtype: torch.dtype) -> _TileConfig:
    if dtype == torch.float32:
        # float32 operands take the FMA path, not tensor cores: smaller tiles avoid spills.
        return _TileConfig(max(32, group_pad), 32, 4 if head_dim <= 32 else 8,
                           2 if head_dim <= 64 else 1)
    return _TileConfig(max(_PREFILL_ROWS, group_pad), 64, 4 if head_dim <= 64 else 8, 2)


def _check_inputs(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int,
) -> int:
    """Validates shapes and dtypes shared by both kernels; returns the number of KV heads."""
    if query.dim() != 3 or k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected query [tokens, heads, head_dim] and K/V caches [slots, kv_heads, "
            f"head_dim], got {tuple(query.shape)}, {tuple(k_cache.shape)}, "
            f"{tuple(v_cache.shape)}")
    head_dim = query.shape[-1]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head_dim {head_dim} is not supported: the kernels need a power of two in "
            f"{SUPPORTED_HEAD_DIMS}")
    if not _is_power_of_two(block_size) or block_size < MIN_BLOCK_SIZE:
        raise ValueError(
            f"block_size {block_size} is not supported: the kernels need a power of two "
            f">= {MIN_BLOCK_SIZE}")
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"query dtype {query.dtype} is not float32, float16 or bfloat16")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (query.dtype, FP8_KV_DTYPE):
        raise ValueError(
            f"K/V cache dtypes {k_cache.dtype}/{v_cache.dtype} are neither the query's "
            f"{query.dtype} nor {FP8_KV_DTYPE}")
    num_kv_heads = k_cache.shape[1]
    if k_cache.shape[2] != head_dim or query.shape[1] % num_kv_heads:
        raise ValueError(
            f"query {tuple(query.shape)} does not match a cache of {num_kv_heads} KV heads "
            f"of dim {k_cache.shape[2]}")
    return num_kv_heads


def _check_index(name: str, tensor: torch.Tensor, dims: int) -> None:
    if tensor.dtype != torch.int32 or tensor.dim() != dims:
        raise ValueError(
            f"{name} must be a {dims}-d int32 tensor, got {tensor.dtype} {tuple(tensor.shape)}")


def _output(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty_like(query)
    if out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(
            f"out {out.dtype} {tuple(out.shape)} does not match the query "
            f"{query.dtype} {tuple(query.shape)}")
    return out


def _window(sliding_window: int | None) -> int:
    if sliding_window is None:
        return _NO_WINDOW
    if not 1 <= sliding_window < _NO_WINDOW:
        raise ValueError(f"sliding_window must be a positive int, got {sliding_window}")
    return sliding_window


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 scores in TF32 would be off by ~1e-3: keep full precision where asked for it.
    return "ieee" if dtype == torch.float32 else "tf32"


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def next_power_of_two(value: int) -> int:
    """The least power of two >= `value` (1 for `value` <= 1)."""
    return 1 << max(value - 1, 0).bit_length()


def _floor_power_of_two(value: int) -> int:
    return 1 << (value.bit_length() - 1)
