"""Decode steps on static buffers: CUDA graphs per batch-size bucket, replayed eagerly on CPU.

A decode-only step of `n` requests is padded to the smallest bucket `B >= n`: its inputs are
copied into the first `n` rows of static buffers, rows `n..B` become padding (token 0 at
position 0, K/V written to the runner's null block, `seq_len` 0 so attention reads nothing),
and the bucket's forward runs over those buffers. On CUDA each bucket's forward is captured
once as a graph (all buckets share one memory pool, captured largest first) and replayed; on
CPU, or with `enforce_eager`, the same buffers, padding and metadata run the forward eagerly,
so tests exercise everything but the capture itself.

Owned by the model runner, which calls `run` for decode-only steps that fit a bucket.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.model.attention import AttentionBackend, AttentionMetadata, DecodeBuffers
from engine.worker.runner_step import TokenPatch

# Forward over (input_ids, positions, metadata) -> hidden [tokens, hidden_size].
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes captured: 1, 2, 4, 8, then steps of 8 to 64 and of 16 beyond, up to and
    including `max_num_seqs`."""
    sizes = {size for size in (1, 2, 4, 8) if size <= max_num_seqs}
    sizes.update(range(16, min(max_num_seqs, 64) + 1, 8))
    sizes.update(range(80, max_num_seqs + 1, 16))
    sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


def bucket_for(batch_size: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding `batch_size` rows; None when none does."""
    return next((bucket for bucket in buckets if bucket >= batch_size), None)


@dataclass(frozen=True)
class DecodeStep:
    """One decode-only step's inputs on the host, a row per request."""

    input_ids: np.ndarray  # [n] int64
    positions: np.ndarray  # [n] int64, the new token's position (its seq_len - 1)
    slot_mapping: np.ndarray  # [n] int64
    block_table: np.ndarray  # [n, blocks] int64, at least the blocks the rows use

    @property
    def batch_size(self) -> int:
        return len(self.input_ids)


class StaticDecodeBuffers:
    """Device buffers sized for the largest bucket, and pinned host copies to fill them from.

    The block table travels through contiguous staging buffers (a step copies only the columns
    its rows use, and a strided slice would not copy asynchronously). Before the host copies
    are rewritten, the previous step's copies out of them must have finished: `fill` waits on
    the event it recorded after them (a step that samples nothing reads nothing back).
    """

    _ROWS = ("input_ids", "positions", "slot_mapping", "seq_lens")

    def __init__(self, max_batch: int, max_blocks_per_seq: int, null_slot: int,
                 device: torch.device) -> None:
        self.null_slot = null_slot
        pin = device.type == "cuda"
        self.host = {
            "input_ids": torch.zeros(max_batch, dtype=torch.int64, pin_memory=pin),
            "positions": torch.zeros(max_batch, dtype=torch.int64, pin_memory=pin),
            "slot_mapping": torch.full((max_batch,), null_slot, dtype=torch.int64,
                                       pin_memory=pin),
            "seq_lens": torch.zeros(max_batch, dtype=torch.int32, pin_memory=pin),
        }
        self.device = {name: tensor.to(device) for name, tensor in self.host.items()}
        self.device["block_table"] = torch.zeros((max_batch, max_blocks_per_seq),
                                                 dtype=torch.int32, device=device)
        self._host_table = torch.zeros(max_batch * max_blocks_per_seq, dtype=torch.int32,
                                       pin_memory=pin)
        self._device_table = torch.zeros_like(self._host_table, device=device)
        self._copied = torch.cuda.Event() if pin else None

    def view(self, batch_size: int) -> DecodeBuffers:
        """The attention buffers of the first `batch_size` rows (views: refills show through)."""
        device = self.device
        return DecodeBuffers(slot_mapping=device["slot_mapping"][:batch_size],
                             block_table=device["block_table"][:batch_size],
                             seq_lens=device["seq_lens"][:batch_size])

    def fill(self, step: DecodeStep, bucket: int) -> None:
        """Copies `step` into rows `0..n` and padding into rows `n..bucket` (host side first,
        then asynchronous copies)."""
        if self._copied is not None:
            self._copied.synchronize()
        n = step.batch_size
        host = self.host
        host["input_ids"][:n] = torch.from_numpy(step.input_ids)
        host["positions"][:n] = torch.from_numpy(step.positions)
        host["slot_mapping"][:n] = torch.from_numpy(step.slot_mapping)
        host["seq_lens"][:n] = torch.from_numpy(step.positions + 1)
        for name in ("input_ids", "positions", "seq_lens"):
            host[name][n:bucket] = 0
        host["slot_mapping"][n:bucket] = self.null_slot
        for name in self._ROWS:
            self.device[name][:bucket].copy_(host[name][:bucket], non_blocking=True)
        num_blocks = step.block_table.shape[1]
        size = n * num_blocks
        self._host_table[:size].view(n, num_blocks).copy_(torch.from_numpy(step.block_table))
        self._device_table[:size].copy_(self._host_table[:size], non_blocking=True)
        self.device["block_table"][:n, :num_blocks].copy_(
            self._device_table[:size].view(n, num_blocks))
        if self._copied is not None:
            self._copied.record()


class DecodeGraphs:
    """Runs decode-only steps on static buffers, by graph replay on CUDA, eagerly elsewhere.

    `capture` (CUDA only) must run after the KV caches exist and before any step; the graphs
    hold the caches' addresses and the buffers', so neither may be reallocated afterwards.
    """

    def __init__(self, backend: AttentionBackend, forward: Forward, buckets: tuple[int, ...],
                 buffers: StaticDecodeBuffers, use_graphs: bool) -> None:
        self.buckets = buckets
        self.buffers = buffers
        self._forward = forward
        self._metadata = {bucket: backend.build_decode_metadata(buffers.view(bucket))
                          for bucket in buckets}
        self._use_graphs = use_graphs
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def run(self, step: DecodeStep, token_patch: TokenPatch | None = None) -> torch.Tensor:
        """Hidden states [n, hidden_size] of the step's `n` rows; `n` must fit a bucket.
        `token_patch` writes the input ids still on the device into the static buffer."""
        bucket = bucket_for(step.batch_size, self.buckets)
        if bucket is None:
            raise ValueError(f"a decode batch of {step.batch_size} exceeds the largest bucket")
        self.buffers.fill(step, bucket)
        if token_patch is not None:
            token_patch.apply(self.buffers.device["input_ids"])
        graph = self._graphs.get(bucket)
        if graph is None:
            return self._forward_bucket(bucket)[: step.batch_size]
        graph[0].replay()
        return graph[1][: step.batch_size]

    def capture(self) -> None:
        """Captures every bucket, largest first, into one shared memory pool."""
        if not self._use_graphs:
            return
        pool = torch.cuda.graph_pool_handle()
        for bucket in sorted(self.buckets, reverse=True):
            self._forward_bucket(bucket)  # warm-up: Triton compiles, allocator settles
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward_bucket(bucket)
            self._graphs[bucket] = (graph, hidden)
        torch.cuda.synchronize()

    def _forward_bucket(self, bucket: int) -> torch.Tensor:
        device = self.buffers.device
        return self._forward(device["input_ids"][:bucket], device["positions"][:bucket],
                             self._metadata[bucket])
