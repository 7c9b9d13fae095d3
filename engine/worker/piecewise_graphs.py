"""Steps that are not decode-only, on static buffers: CUDA graphs of the forward's pieces
between attentions, per token-count bucket, replayed eagerly on CPU.

A step of prefills, chunks or decodes mixed with them cannot replay one graph of the whole
forward: its attention plan (how many sequences, how long, how many key splits) changes the
kernels' grids every step. Everything else in a layer (norms, projections, rotary, SiLU,
residual adds) depends only on the step's token count. So the forward is cut at each
layer's attention (`LlamaForCausalLM.num_pieces`): the pieces between attentions are
captured once per token-count bucket, and a step of `n` tokens, padded to the smallest
bucket `B >= n`, replays them with each layer's attention run eagerly in between, over its
`n` real rows only. The padding rows never reach the KV cache (the attention writes the
step's `n` rows) and no real row reads them (every piece works row by row), so their stale
values are harmless.

Each piece reads static buffers (the step's input ids and positions, the last attention's
output, the residual stream) and copies what it produces into static buffers (the next
attention's query, key and value, the residual stream, or the final hidden states), so no
tensor of the graphs' memory pool lives from one piece to the next, and the buckets' graphs
can share that pool in any order of replay.

Where an eager step is bound by the host's launches (a short chunk over a long context: a
few hundred kernels a step, each launched from Python), the graphs leave it the attention's
launches and one replay a piece. Large steps gain little where their device time exceeds
their launches', so buckets stop at `ModelConfig.piecewise_max_tokens` (512 by default).

Owned by the model runner, which calls `run` for the steps that fit a bucket and are not
decode-only steps on the decode graphs (`decode_graphs.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.model.attention import AttentionMetadata
from engine.model.llama import AttentionInputs, LlamaForCausalLM
from engine.worker.decode_graphs import bucket_for

# The small buckets end here, at a power of two, from which each doubling has a few buckets.
_SMALL_BUCKETS_MAX = 512
# 8, 16, then steps of 16 to 64, of 32 to 256 and of 64 to `_SMALL_BUCKETS_MAX`.
_SMALL_BUCKETS = (8, 16, *range(32, 65, 16), *range(96, 257, 32),
                  *range(320, _SMALL_BUCKETS_MAX + 1, 64))
# Above the small buckets, each doubling is cut in this many equal steps: at 4 a step of n
# tokens pads fewer than n / 4 rows.
_BUCKETS_A_DOUBLING = 4


def piecewise_buckets(max_num_batched_tokens: int, piecewise_max_tokens: int
                      ) -> tuple[int, ...]:
    """Token counts captured: the small buckets (8, 16, then steps of 16 to 64, of 32 to 256
    and of 64 to 512), then steps of a quarter of the last power of two (640, 768, 896,
    1,024, 1,280, ...), up to `piecewise_max_tokens` (`ModelConfig.piecewise_max_tokens`);
    the smaller of that and the step budget is itself the largest bucket."""
    limit = min(max_num_batched_tokens, piecewise_max_tokens)
    sizes = set(_SMALL_BUCKETS)
    power = _SMALL_BUCKETS_MAX
    while power < limit:
        step = power // _BUCKETS_A_DOUBLING
        sizes.update(range(power + step, 2 * power + 1, step))
        power *= 2
    return tuple(sorted({size for size in sizes if size < limit} | {limit}))


class PiecewiseGraphs:
    """Runs steps of at most `max(buckets)` tokens by pieces on static buffers: each piece a
    CUDA graph replay after `capture` (CUDA only), eagerly otherwise (CPU tests).

    Owned by the model runner, built once its KV pool exists; `capture` runs before any
    step. The graphs hold the buffers' addresses, not the KV caches' (only the eager
    attention reads those).
    """

    def __init__(self, model: LlamaForCausalLM, buckets: Sequence[int], device: torch.device,
                 dtype: torch.dtype, use_graphs: bool) -> None:
        if not buckets or model.num_pieces < 2:
            raise ValueError("piecewise graphs need a bucket and a model with layers")
        arch = model.arch
        rows = max(buckets)
        self.model = model
        self.buckets = tuple(sorted(buckets))
        self._use_graphs = use_graphs
        self._input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self._positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self._query = torch.zeros((rows, arch.num_attention_heads, arch.head_dim), dtype=dtype,
                                  device=device)
        self._key = torch.zeros((rows, arch.num_key_value_heads, arch.head_dim), dtype=dtype,
                                device=device)
        self._value = torch.zeros_like(self._key)
        self._attention_out = torch.zeros_like(self._query)
        self._residual = torch.zeros((rows, arch.hidden_size), dtype=dtype, device=device)
        self._hidden = torch.zeros_like(self._residual)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    @property
    def captured(self) -> bool:
        """Whether the pieces replay CUDA graphs (else they run eagerly)."""
        return bool(self._graphs)

    def fits(self, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` tokens runs here."""
        return num_tokens <= self.buckets[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            kv_caches: list[torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states [n, hidden_size] of a step of `n` tokens (`fits(n)`): a view of a
        static buffer, valid until the next step runs."""
        num_tokens = input_ids.shape[0]
        bucket = bucket_for(num_tokens, self.buckets)
        if bucket is None:
            raise ValueError(f"a step of {num_tokens} tokens exceeds the largest bucket")
        if len(kv_caches) != self.model.num_pieces - 1:
            raise ValueError(f"{len(kv_caches)} KV caches for {self.model.num_pieces - 1} layers")
        self._input_ids[:num_tokens].copy_(input_ids)
        self._positions[:num_tokens].copy_(positions)
        inputs = AttentionInputs(self._query[:num_tokens], self._key[:num_tokens],
                                 self._value[:num_tokens], self._residual[:num_tokens])
        for index in range(self.model.num_pieces):
            graph = self._graphs.get((bucket, index))
            if graph is None:
                self._run_piece(bucket, index)
            else:
                graph.replay()
            if index < len(kv_caches):  # the last piece has no attention after it
                self.model.attend(index, inputs, kv_caches[index], metadata,
                                  out=self._attention_out[:num_tokens])
        return self._hidden[:num_tokens]

    def capture(self) -> None:
        """Captures every bucket's pieces, largest bucket first, into one memory pool."""
        if not self._use_graphs:
            return
        pool = torch.cuda.graph_pool_handle()
        pieces = range(self.model.num_pieces)
        for bucket in reversed(self.buckets):
            for index in pieces:  # warm-up: Triton compiles, the allocator settles
                self._run_piece(bucket, index)
            torch.cuda.synchronize()
            for index in pieces:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._run_piece(bucket, index)
                self._graphs[(bucket, index)] = graph
        torch.cuda.synchronize()

    def _run_piece(self, bucket: int, index: int) -> None:
        """Piece `index` over the buffers' first `bucket` rows, its products copied into them."""
        model = self.model
        if index == model.num_pieces - 1:
            self._hidden[:bucket].copy_(model.head_piece(self._attention_out[:bucket],
                                                         self._residual[:bucket]))
            return
        rotary = model.rotary_of(self._positions[:bucket])
        if index == 0:
            inputs = model.embed_piece(self._input_ids[:bucket], rotary)
        else:
            inputs = model.layer_piece(index, self._attention_out[:bucket],
                                       self._residual[:bucket], rotary)
        for buffer, product in zip((self._query, self._key, self._value, self._residual),
                                   inputs, strict=True):
            buffer[:bucket].copy_(product)
