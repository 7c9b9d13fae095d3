"""The Triton attention backend: kernels that read K/V straight from the paged cache.

Decode runs split-K (flash-decoding) over each sequence's blocks; prefill and chunked extend
run one causal kernel over the cached prefix and the step's own tokens. Nothing is gathered
into a workspace, and no step reads a device value on the host, so a decode plan over static
buffers can be captured in a CUDA graph. On CPU the same kernels run under Triton's
interpreter (`TRITON_INTERPRET=1`, for tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.model.attention import triton_kernels
from engine.model.attention.backend import (
    AttentionBackend,
    AttentionLayout,
    AttentionMetadata,
    DecodeBuffers,
    FlatStep,
    to_device,
)
from engine.model.triton_support import check_triton_runs_on

# Triton compiles float8 e4m3 only for GPUs of this compute capability or newer (Ada, Hopper).
MIN_FP8_CAPABILITY = (8, 9)


def check_float8_runs_on(device: torch.device) -> None:
    """ValueError when the kernels cannot read a float8 cache on `device` (a CUDA GPU older
    than `MIN_FP8_CAPABILITY`); the CPU's interpreter can."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_FP8_CAPABILITY:
        raise ValueError(
            f"kv_cache_dtype fp8 needs a GPU of compute capability "
            f"{'.'.join(map(str, MIN_FP8_CAPABILITY))} or newer for Triton's float8 e4m3; "
            f"this one has {'.'.join(map(str, capability))}")


@dataclass(frozen=True)
class DecodePlan:
    """The decodes of a step: rows `[0, batch)` of its flat batch."""

    block_table: torch.Tensor  # [batch, blocks] int32
    seq_lens: torch.Tensor  # [batch] int32
    num_splits: int


@dataclass(frozen=True)
class PrefillPlan:
    """The longer queries of a step, flattened after its decodes."""

    block_table: torch.Tensor  # [seqs, blocks] int32
    query_start_loc: torch.Tensor  # [seqs + 1] int32, relative to the first prefill token
    seq_lens: torch.Tensor  # [seqs] int32
    max_query_len: int


@dataclass(frozen=True)
class TritonMetadata(AttentionMetadata):
    positions: np.ndarray
    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode: DecodePlan | None
    prefill: PrefillPlan | None
    layout: AttentionLayout

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        triton_kernels.store_kv(key, value, k_cache, v_cache, self.slot_mapping)
        output = torch.empty_like(query)
        split = self.num_decode_tokens
        block_size, window = self.layout.block_size, self.layout.sliding_window
        if self.decode is not None:
            triton_kernels.paged_decode_attention(
                query[:split], k_cache, v_cache, self.decode.block_table, self.decode.seq_lens,
                scale, block_size=block_size, num_splits=self.decode.num_splits,
                sliding_window=window, out=output[:split])
        if self.prefill is not None:
            triton_kernels.paged_prefill_attention(
                query[split:], k_cache, v_cache, self.prefill.block_table,
                self.prefill.query_start_loc, self.prefill.seq_lens, scale,
                block_size=block_size, max_query_len=self.prefill.max_query_len,
                sliding_window=window, out=output[split:])
        return output


class TritonBackend(AttentionBackend):
    """Paged attention in Triton kernels; needs CUDA, or the interpreter on CPU."""

    name = "triton"
    supports_static_decode = True

    def __init__(self, layout: AttentionLayout) -> None:
        if not triton_kernels.supports(layout.head_dim, layout.block_size):
            raise ValueError(
                f"the triton attention backend does not cover head_dim={layout.head_dim} with "
                f"block_size={layout.block_size} (head_dim 32, 64 or 128 and a power-of-two "
                "block_size >= 8); use --attention-backend sdpa")
        check_triton_runs_on(layout.device, "the triton attention backend")
        if layout.cache_dtype not in (layout.dtype, triton_kernels.FP8_KV_DTYPE):
            raise ValueError(f"the triton attention backend reads a KV cache of the model's "
                             f"dtype or {triton_kernels.FP8_KV_DTYPE}, not {layout.cache_dtype}")
        if layout.cache_dtype == triton_kernels.FP8_KV_DTYPE:
            check_float8_runs_on(layout.device)
        super().__init__(layout)

    def build_metadata(self, query_lens: np.ndarray, context_lens: np.ndarray,
                       block_table: np.ndarray) -> TritonMetadata:
        layout = self.layout
        step = FlatStep.of(query_lens, context_lens, block_table, layout.block_size)
        query_lens, seq_lens, num_decodes = step.query_lens, step.seq_lens, step.num_decodes
        return TritonMetadata(
            positions=step.positions,
            slot_mapping=to_device(step.slots, layout.device),
            num_decode_tokens=num_decodes,
            decode=self._decode_plan(seq_lens[:num_decodes], block_table[:num_decodes])
            if num_decodes else None,
            prefill=self._prefill_plan(query_lens[num_decodes:], seq_lens[num_decodes:],
                                       block_table[num_decodes:])
            if num_decodes < len(query_lens) else None,
            layout=layout,
        )

    def build_decode_metadata(self, buffers: DecodeBuffers) -> TritonMetadata:
        layout = self.layout
        num_splits = triton_kernels.default_num_splits(
            layout.max_model_len, layout.block_size, buffers.batch_size, layout.num_kv_heads)
        return TritonMetadata(
            positions=np.zeros(0, dtype=np.int64),
            slot_mapping=buffers.slot_mapping,
            num_decode_tokens=buffers.batch_size,
            decode=DecodePlan(buffers.block_table, buffers.seq_lens, num_splits),
            prefill=None,
            layout=layout,
        )

    def _decode_plan(self, seq_lens: np.ndarray, block_table: np.ndarray) -> DecodePlan:
        max_seq_len = int(seq_lens.max())
        num_blocks = -(-max_seq_len // self.layout.block_size)
        return DecodePlan(
            block_table=self._device_int32(block_table[:, :num_blocks]),
            seq_lens=self._device_int32(seq_lens),
            num_splits=triton_kernels.default_num_splits(
                max_seq_len, self.layout.block_size, len(seq_lens), self.layout.num_kv_heads),
        )

    def _prefill_plan(self, query_lens: np.ndarray, seq_lens: np.ndarray,
                      block_table: np.ndarray) -> PrefillPlan:
        num_blocks = -(-int(seq_lens.max()) // self.layout.block_size)
        return PrefillPlan(
            block_table=self._device_int32(block_table[:, :num_blocks]),
            query_start_loc=self._device_int32(np.concatenate([[0], np.cumsum(query_lens)])),
            seq_lens=self._device_int32(seq_lens),
            max_query_len=int(query_lens.max()),
        )

    def _device_int32(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.layout.device, np.int32)
