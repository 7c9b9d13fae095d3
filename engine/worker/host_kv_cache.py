"""The host tier's KV tensors and the block copies between them and the device pool: the
runner's side of `engine.kv_cache.transfers` (the scheduler decides which copies; this module
only carries them out, in the order `KVTransfers` prescribes)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kv_cache.transfers import KVTransfers


def token_rows(block_ids: Sequence[int], block_size: int, device: torch.device) -> torch.Tensor:
    """Indices along a layer cache's token dimension (dim 1) of the blocks' slots, block by
    block in the given order."""
    ids = torch.tensor(block_ids, dtype=torch.int64)
    rows = (ids[:, None] * block_size + torch.arange(block_size, dtype=torch.int64)).flatten()
    return rows.to(device)


@dataclass
class _StagedStore:
    """Device blocks gathered into pinned host buffers (one per layer) by an asynchronous
    copy, to be scattered into the host cache once the side stream has finished."""

    buffers: list[torch.Tensor]
    host_rows: torch.Tensor


class HostKVCache:
    """The host tier's blocks, one tensor per layer laid out like the device pool's
    (`(2, num_blocks * block_size, kv_heads, head_dim)`, same dtype): pinned memory when the
    pool is on CUDA, ordinary tensors when it is on CPU (the same path, synchronous).

    Owned by the model runner, which calls `copy_before_forward` with each step's
    `KVTransfers` before the step's forward (even when no token is scheduled) and
    `finish` after it; every copy is done when `finish` returns. It holds the runner's
    device caches by reference and writes device blocks only in a step's loads and in
    `load_blocks` (the start-up reload profile, before any request holds a block).
    """

    def __init__(self, device_caches: list[torch.Tensor], num_blocks: int,
                 block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the host KV cache needs at least one block, got {num_blocks}")
        self.device_caches = device_caches
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device_caches[0].device
        on_cuda = self.device.type == "cuda"
        # Zeros, not uninitialised memory: a block loaded before it was ever stored (only the
        # start-up reload profile does that) must not bring NaNs into the device pool.
        self.caches = [
            torch.zeros((cache.shape[0], num_blocks * block_size, *cache.shape[2:]),
                        dtype=cache.dtype, pin_memory=on_cuda)
            for cache in device_caches
        ]
        self._stream = torch.cuda.Stream(self.device) if on_cuda else None
        self._lazy_stores: list[tuple[int, int]] = []
        self._staged_lazy_stores: _StagedStore | None = None

    def copy_before_forward(self, transfers: KVTransfers) -> None:
        """Carries out the urgent stores, then the loads; the forward that follows sees the
        loaded blocks. On CUDA they run on a side stream that the compute stream waits for,
        and the lazy stores start there too, overlapping the forward; on CPU the lazy stores
        are left for `finish`."""
        if self._stream is None:
            self._store(transfers.urgent_stores)
            self._load(transfers.loads)
            self._lazy_stores = list(transfers.stores)
            return
        compute_stream = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute_stream)  # the KV written by earlier steps
        if transfers.urgent_stores:
            staged = self._stage_store(transfers.urgent_stores)
            self._stream.synchronize()  # a load below may read what these write
            self._scatter_on_host(staged)
        if transfers.loads:
            self._load(transfers.loads)
            compute_stream.wait_stream(self._stream)
        if transfers.stores:
            self._staged_lazy_stores = self._stage_store(transfers.stores)

    def finish(self) -> None:
        """Completes the step's lazy stores (call after the forward)."""
        if self._stream is None:
            lazy_stores, self._lazy_stores = self._lazy_stores, []
            self._store(lazy_stores)
            return
        staged, self._staged_lazy_stores = self._staged_lazy_stores, None
        if staged is not None:
            self._stream.synchronize()
            self._scatter_on_host(staged)

    def load_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copies (host block, device block) pairs at once, ordered before later compute; for
        timing loads (the caller synchronises)."""
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        self._load(pairs)
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def _store(self, pairs: Sequence[tuple[int, int]]) -> None:
        """CPU: device -> host, one gather and one scatter per layer."""
        if not pairs:
            return
        device_rows = token_rows([device for device, _ in pairs], self.block_size, self.device)
        host_rows = token_rows([host for _, host in pairs], self.block_size, torch.device("cpu"))
        for device_cache, host_cache in zip(self.device_caches, self.caches, strict=True):
            host_cache.index_copy_(1, host_rows, device_cache.index_select(1, device_rows))

    def _load(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Host -> device, one gather and one scatter per layer (on CUDA, the gather into a
        pinned buffer on the CPU, then an asynchronous copy and the scatter on the side
        stream)."""
        if not pairs:
            return
        host_rows = token_rows([host for host, _ in pairs], self.block_size, torch.device("cpu"))
        if self._stream is None:
            device_rows = token_rows([device for _, device in pairs], self.block_size,
                                     self.device)
            for host_cache, device_cache in zip(self.caches, self.device_caches, strict=True):
                device_cache.index_copy_(1, device_rows, host_cache.index_select(1, host_rows))
            return
        with torch.cuda.stream(self._stream):
            device_rows = token_rows([device for _, device in pairs], self.block_size,
                                     self.device)
            for host_cache, device_cache in zip(self.caches, self.device_caches, strict=True):
                staging = torch.empty((host_cache.shape[0], len(host_rows),
                                       *host_cache.shape[2:]),
                                      dtype=host_cache.dtype, pin_memory=True)
                torch.index_select(host_cache, 1, host_rows, out=staging)
                device_cache.index_copy_(1, device_rows,
                                         staging.to(self.device, non_blocking=True))

    def _stage_store(self, pairs: Sequence[tuple[int, int]]) -> _StagedStore:
        """CUDA: gathers the device blocks on the side stream and copies them asynchronously
        into pinned buffers; `_scatter_on_host` finishes once the stream has synchronised."""
        assert self._stream is not None
        with torch.cuda.stream(self._stream):
            device_rows = token_rows([device for device, _ in pairs], self.block_size,
                                     self.device)
            buffers = []
            for device_cache in self.device_caches:
                gathered = device_cache.index_select(1, device_rows)
                buffer = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
                buffer.copy_(gathered, non_blocking=True)
                buffers.append(buffer)
        host_rows = token_rows([host for _, host in pairs], self.block_size, torch.device("cpu"))
        return _StagedStore(buffers, host_rows)

    def _scatter_on_host(self, staged: _StagedStore) -> None:
        for host_cache, buffer in zip(self.caches, staged.buffers, strict=True):
            host_cache.index_copy_(1, staged.host_rows, buffer)
