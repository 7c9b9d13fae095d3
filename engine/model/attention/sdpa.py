"""The SDPA attention backend: paged attention in torch (cache layout in `backend.py`).

- Decodes are attended in groups of similar length: each group's blocks are gathered into a
  padded `[B, L]` view (in a reused workspace) and one SDPA call runs with a length mask.
- Every longer query (a prefill, or a chunk on top of cached tokens) is attended on its own.
  With no cached context it attends to its fresh K/V under a plain causal mask; otherwise it
  gathers its whole sequence from the cache under a bottom-right-aligned causal mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from engine.model.attention.backend import (
    AttentionBackend,
    AttentionLayout,
    AttentionMetadata,
    FlatStep,
    to_device,
    write_kv,
)

_DECODE_GROUP_LENGTH_RATIO = 0.75
_MIN_DECODE_GROUP = 16
# Scores (float32, and their softmax) of one masked prefill slice on CUDA.
_MAX_SCORE_BYTES = 256 * 2**20


class GatherWorkspace:
    """Reusable buffers for K/V rows gathered out of the paged cache (index 0 for K, 1 for V).

    Allocating the gathered tensors afresh in every layer of every step costs more than the
    attention itself on CPU (large allocations are fresh pages, faulted in and zeroed). The
    buffers only grow; the model runner keeps one workspace for its lifetime.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None, None]

    def gather(self, which: int, source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """`source.index_select(0, index)`, written into buffer `which`; valid until the next
        gather into the same buffer."""
        row_shape = source.shape[1:]
        num_elements = index.numel() * math.prod(row_shape)
        buffer = self._buffers[which]
        if (buffer is None or buffer.numel() < num_elements or buffer.dtype != source.dtype
                or buffer.device != source.device):
            buffer = torch.empty(num_elements, dtype=source.dtype, device=source.device)
            self._buffers[which] = buffer
        out = buffer[:num_elements].view(index.numel(), *row_shape)
        return torch.index_select(source, 0, index, out=out)


@dataclass(frozen=True)
class DecodeGroup:
    """Single-token queries `[start, start + B)` of similar length, attended in one call:
    `block_table` [B, max_blocks], `mask` [B, 1, 1, L] additive (0 attends, -inf does not;
    cheaper for SDPA than a boolean mask)."""

    start: int
    block_table: torch.Tensor
    mask: torch.Tensor

    @property
    def size(self) -> int:
        return self.block_table.shape[0]


@dataclass(frozen=True)
class PrefillSeq:
    """A multi-token query at `[query_start, query_start + query_len)` of the flat batch.

    `kv_slots` (all `context_len + query_len` slots of the sequence) and `mask` are `None`
    when the query has no cached context and no sliding window: then a plain causal mask over
    the fresh K/V is enough.
    """

    query_start: int
    query_len: int
    context_len: int
    kv_slots: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(frozen=True)
class SdpaMetadata(AttentionMetadata):
    """How one step's flattened tokens map onto the paged cache for the SDPA backend."""

    positions: np.ndarray
    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_groups: tuple[DecodeGroup, ...]
    prefills: tuple[PrefillSeq, ...]
    block_size: int
    workspace: GatherWorkspace = field(default_factory=GatherWorkspace)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        return paged_attention(query, key, value, kv_cache, self, scale)


class SdpaBackend(AttentionBackend):
    """Today's attention in torch: gathers K/V out of the cache and calls SDPA. Runs on every
    device; the CPU default.

    On CPU, gathered K/V live in one grow-only workspace (fresh large allocations are
    page-faulted and zeroed every layer); CUDA's caching allocator already reuses memory, so
    there a step's workspace is transient (and counted by `transient_bytes_per_kv_token`).
    """

    name = "sdpa"

    def __init__(self, layout: AttentionLayout) -> None:
        if layout.cache_dtype != layout.dtype:
            raise ValueError(
                f"the sdpa attention backend reads a KV cache of the model's dtype only, not "
                f"{layout.cache_dtype}; use --attention-backend triton (or kv_cache_dtype auto)")
        super().__init__(layout)
        self.workspace = GatherWorkspace() if layout.device.type == "cpu" else None

    def build_metadata(self, query_lens: np.ndarray, context_lens: np.ndarray,
                       block_table: np.ndarray) -> SdpaMetadata:
        layout = self.layout
        step = FlatStep.of(query_lens, context_lens, block_table, layout.block_size)
        query_lens, context_lens, seq_lens = step.query_lens, step.context_lens, step.seq_lens
        num_decodes = step.num_decodes
        starts = np.cumsum(query_lens) - query_lens
        return SdpaMetadata(
            positions=step.positions,
            slot_mapping=to_device(step.slots, layout.device),
            num_decode_tokens=num_decodes,
            decode_groups=tuple(
                _decode_group(start, seq_lens[start:end], block_table[start:end],
                              layout.block_size, layout.sliding_window, layout.device,
                              layout.dtype)
                for start, end in group_decodes(seq_lens[:num_decodes])
            ),
            prefills=tuple(
                _prefill_seq(int(starts[i]), int(query_lens[i]), int(context_lens[i]),
                             block_table[i], layout.block_size, layout.sliding_window,
                             layout.device)
                for i in range(num_decodes, len(query_lens))
            ),
            block_size=layout.block_size,
            workspace=GatherWorkspace() if self.workspace is None else self.workspace,
        )

    def scratch_bytes(self, num_kv_tokens: int) -> int:
        """K and V rows gathered for one layer (the workspace grows to the step's largest
        gather): a decode group grown past `_MIN_DECODE_GROUP` members pads each to at most
        1 / `_DECODE_GROUP_LENGTH_RATIO` of its length (in blocks, which the pool holds), a
        smaller group pads each of its members to its longest sequence, and a prefill over
        cached context gathers one sequence; SDPA's math kernel then expands that sequence's
        K/V to every query head and materialises at most `_MAX_SCORE_BYTES` of scores."""
        layout = self.layout
        row_bytes = 2 * layout.num_kv_heads * layout.head_dim * layout.dtype.itemsize
        max_seq_tokens = layout.max_blocks_per_seq * layout.block_size
        expanded_bytes = 2 * layout.num_heads * layout.head_dim * layout.dtype.itemsize \
            * max_seq_tokens
        return math.ceil(num_kv_tokens / _DECODE_GROUP_LENGTH_RATIO) * row_bytes \
            + _MIN_DECODE_GROUP * max_seq_tokens * row_bytes + expanded_bytes \
            + _MAX_SCORE_BYTES


def group_decodes(seq_lens: np.ndarray) -> list[tuple[int, int]]:
    """Splits decodes into contiguous `[start, end)` groups of similar length.

    Each group is padded to its longest sequence, so grouping sequences whose lengths are
    within `_DECODE_GROUP_LENGTH_RATIO` of each other bounds the padding; the runner orders
    decodes longest first so that groups are contiguous. Groups have at least
    `_MIN_DECODE_GROUP` members (but the last), as every group costs one attention call.
    """
    groups = []
    start = 0
    longest = shortest = 0
    for index, seq_len in enumerate(seq_lens.tolist()):
        if index == start:
            longest = shortest = seq_len
            continue
        longest, shortest = max(longest, seq_len), min(shortest, seq_len)
        if index - start >= _MIN_DECODE_GROUP and shortest < _DECODE_GROUP_LENGTH_RATIO * longest:
            groups.append((start, index))
            start, longest, shortest = index, seq_len, seq_len
    if len(seq_lens):
        groups.append((start, len(seq_lens)))
    return groups


def _decode_group(
    start: int, seq_lens: np.ndarray, block_table: np.ndarray, block_size: int,
    sliding_window: int | None, device: torch.device, dtype: torch.dtype,
) -> DecodeGroup:
    num_blocks = int(-(-seq_lens.max() // block_size))
    key_positions = np.arange(num_blocks * block_size)
    allowed = key_positions[None, :] < seq_lens[:, None]
    if sliding_window is not None:
        allowed &= key_positions[None, :] > seq_lens[:, None] - 1 - sliding_window
    mask = np.where(allowed, np.float32(0.0), np.float32(-np.inf))
    return DecodeGroup(
        start=start,
        block_table=to_device(block_table[:, :num_blocks], device),
        mask=to_device(mask[:, None, None, :], device).to(dtype),
    )


def _prefill_seq(
    query_start: int, query_len: int, context_len: int, block_ids: np.ndarray,
    block_size: int, sliding_window: int | None, device: torch.device,
) -> PrefillSeq:
    if context_len == 0 and sliding_window is None:
        return PrefillSeq(query_start, query_len, context_len, None, None)
    seq_len = context_len + query_len
    key_positions = np.arange(seq_len)
    slots = block_ids[key_positions // block_size] * block_size + key_positions % block_size
    query_positions = np.arange(context_len, seq_len)[:, None]
    allowed = key_positions[None, :] <= query_positions
    if sliding_window is not None:
        allowed &= key_positions[None, :] > query_positions - sliding_window
    return PrefillSeq(
        query_start, query_len, context_len,
        kv_slots=to_device(slots, device),
        mask=to_device(allowed[None, None], device),
    )


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: SdpaMetadata,
    scale: float,
) -> torch.Tensor:
    """`SdpaMetadata.attend`: writes this step's K/V, then attends (decode groups, then each
    longer query on its own)."""
    write_kv(kv_cache, key, value, metadata.slot_mapping)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if not metadata.prefills and len(metadata.decode_groups) == 1:
        return _attend_decodes(query, k_cache, v_cache, metadata, metadata.decode_groups[0],
                               scale)
    output = torch.empty_like(query)
    for group in metadata.decode_groups:
        end = group.start + group.size
        output[group.start:end] = _attend_decodes(query[group.start:end], k_cache, v_cache,
                                                  metadata, group, scale)
    for seq in metadata.prefills:
        end = seq.query_start + seq.query_len
        if seq.kv_slots is None:
            seq_key, seq_value = key[seq.query_start:end], value[seq.query_start:end]
        else:
            seq_key = metadata.workspace.gather(0, k_cache, seq.kv_slots)
            seq_value = metadata.workspace.gather(1, v_cache, seq.kv_slots)
        output[seq.query_start:end] = sdpa_in_row_slices(
            query[seq.query_start:end], seq_key, seq_value, seq.mask, scale,
            _MAX_SCORE_BYTES if query.device.type == "cuda" else None)
    return output


def _attend_decodes(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    metadata: SdpaMetadata, group: DecodeGroup, scale: float,
) -> torch.Tensor:
    batch, num_blocks = group.block_table.shape
    kv_heads, head_dim = k_cache.shape[1:]
    blocks_shape = (-1, metadata.block_size, kv_heads, head_dim)
    seq_shape = (batch, num_blocks * metadata.block_size, kv_heads, head_dim)
    block_ids = group.block_table.flatten()
    workspace = metadata.workspace
    keys = workspace.gather(0, k_cache.view(blocks_shape), block_ids).view(seq_shape)
    values = workspace.gather(1, v_cache.view(blocks_shape), block_ids).view(seq_shape)
    # The query heads sharing a KV head attend as a group of "positions" over that head: no
    # K/V expansion for GQA (about 2x faster than `enable_gqa` on CPU), same result.
    num_heads = query.shape[1]
    grouped = query.view(batch, kv_heads, num_heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        grouped, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=group.mask,
        scale=scale,
    )
    return out.reshape(batch, num_heads, head_dim)


def sdpa_in_row_slices(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    mask: torch.Tensor | None, scale: float, max_score_bytes: int | None,
) -> torch.Tensor:
    """One sequence's [tokens, heads, head_dim] attention. A masked query (a chunk over cached
    context, or a sliding window) takes SDPA's math kernel on CUDA, which materialises its
    scores: given `max_score_bytes` (the runner gives it on CUDA), it runs in slices of query
    rows whose float32 scores and softmax stay within it; else in one call."""
    rows = query.shape[0]
    if mask is not None and max_score_bytes is not None:
        score_bytes_per_row = 2 * 4 * query.shape[1] * key.shape[0]
        rows = max(1, max_score_bytes // score_bytes_per_row)
    parts = [
        _sdpa(query[start:start + rows].unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0),
              None if mask is None else mask[..., start:start + rows, :], scale).squeeze(0)
        for start in range(0, query.shape[0], rows)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    mask: torch.Tensor | None, scale: float,
) -> torch.Tensor:
    """SDPA on [batch, tokens, heads, head_dim] tensors; `mask=None` means causal."""
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
        attn_mask=mask, is_causal=mask is None, scale=scale,
        enable_gqa=query.shape[2] != key.shape[2],
    )
    return out.transpose(1, 2)
