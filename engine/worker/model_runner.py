"""The model runner: executes one `SchedulerOutput` and returns the sampled tokens.

Owned by an executor; `submit` is called once per engine step and returns the launched step,
whose `result` waits for its sampled tokens (`execute_model` does both). Each step it
1. updates the persistent batch (drops finished and preempted requests, adds new and resumed
   ones, appends new blocks),
2. lays the scheduled tokens out decodes-first and builds positions, slot mapping and
   attention metadata (through the attention backend); an input token that an earlier step
   sampled and the host has not read back yet is taken from the device (`runner_step.py`),
3. runs the model (a decode-only step on static buffers, replaying a CUDA graph where
   available: `decode_graphs.py`), computes logits only for requests that reach the end of
   their known tokens (a partial prefill samples nothing), samples, appends placeholders for
   the sampled tokens to its rows and starts copying the ids to pinned host memory; `result`
   waits for that copy and fills the placeholders in;
4. for requests that ask for prompt logprobs, computes the logprobs of the prompt tokens that
   the step's positions predict (in chunks of rows, so a long prompt never holds the logits of
   all its positions at once).
Nothing in a step waits for the device unless it needs token ids on the host (a step with
prompt logprobs reads them back before it returns), but for the static decode buffers, which
are refilled once their previous copies have finished. The step's inputs, attention metadata
and sampling inputs go to the device by asynchronous copies from pinned memory, and the
penalties count the sampled ids on the device (`token_counts.py`).
With a host tier it also carries out the step's copies (`kv_transfers`), even in a step that
schedules no token: urgent stores and loads before the forward, lazy stores overlapping it,
all done before the step returns.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.config import EngineConfig
from engine.model.attention import (
    AttentionLayout,
    AttentionMetadata,
    make_attention_backend,
)
from engine.model.attention.backend import ProfiledStep, slot_mapping, step_positions, to_device
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import load_model, resolve_device, resolve_dtype
from engine.outputs import (
    CompletedStep,
    ModelRunnerOutput,
    PendingStep,
    PromptLogprobs,
    TokenLogprobs,
)
from engine.sample.metadata import SamplingMetadata
from engine.sample.sampler import SampledLogprobs, Sampler, gather_logprobs
from engine.sampling_params import MAX_LOGPROBS
from engine.scheduler.output import SchedulerOutput
from engine.worker.decode_graphs import (
    DecodeGraphs,
    DecodeStep,
    StaticDecodeBuffers,
    bucket_for,
    decode_buckets,
)
from engine.worker.host_kv_cache import HostKVCache
from engine.worker.input_batch import InputBatch
from engine.worker.kv_cache_sizing import (
    determine_num_host_kv_blocks,
    determine_num_kv_blocks,
    kv_block_bytes,
    resolve_kv_cache_dtype,
)
from engine.worker.runner_step import PendingTokens, RunnerStep, TokenPatch
from engine.worker.token_counts import TokenCounts

# At most this many bytes of float32 logits exist at once while prompt logprobs are computed.
PROMPT_LOGITS_CHUNK_BYTES = 128 * 2**20


@dataclass(frozen=True)
class PromptLogprobSpan:
    """Prompt positions of one request computed in a step, whose logits give prompt logprobs:
    the step's tokens `first_token_index ..+ num_positions` predict prompt tokens
    `start_index ..+ num_positions` (of batch row `row`)."""

    req_id: str
    row: int
    first_token_index: int
    start_index: int
    num_positions: int


@dataclass(frozen=True)
class StepInputs:
    """The flattened batch of one step: request order, model inputs, and sampling rows."""

    req_ids: list[str]
    # Either an eager forward's inputs (`input_ids`, `positions`, `metadata`) or, for a
    # decode-only step on static buffers, `decode_step` (the three others then None).
    input_ids: torch.Tensor | None
    positions: torch.Tensor | None
    metadata: AttentionMetadata | None
    decode_step: DecodeStep | None
    logits_indices: torch.Tensor  # token index of each sampling request's last token
    sampling_rows: list[int]  # batch rows of the sampling requests, in `logits_indices` order
    sampling_req_ids: list[str]
    prompt_logprob_spans: list[PromptLogprobSpan]
    token_patch: TokenPatch | None  # input ids still on the device, from earlier steps


class ModelRunner:
    """Holds the model, the KV caches (one tensor per layer), the host tier's caches (when
    `kv_offload_gib` > 0; `num_host_kv_blocks` is 0 without) and the persistent batch."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        max_model_len = config.scheduler.max_model_len
        self.model: LlamaForCausalLM = load_model(
            config.model, self.device, self.dtype, max_model_len
        )
        self.arch = self.model.arch
        self.block_size = config.cache.block_size
        self.kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype)
        self.attention = make_attention_backend(
            config.model.attention_backend,
            AttentionLayout.of_model(self.arch, self.block_size, self.device, self.dtype,
                                     max_model_len, self.kv_dtype))
        self.decode_buckets = (
            decode_buckets(config.scheduler.max_num_seqs)
            if self.attention.supports_static_decode else ())
        # On CUDA the profile always runs: its forwards also compile the kernels and tune the
        # prefill tile (at the full budget, and apart for each other kernel variant the
        # backend names), before the pool exists.
        profiled_bytes = self._profile_reserved_bytes() if self.device.type == "cuda" else 0
        reserved_bytes = profiled_bytes if config.cache.num_kv_blocks is None else 0
        self.num_kv_blocks = determine_num_kv_blocks(
            config.cache, self.arch, self.kv_dtype, self.device, max_model_len, reserved_bytes,
            self.attention.scratch_bytes,
        )
        self.kv_caches = self._allocate_kv_caches(self.num_kv_blocks)
        self.num_host_kv_blocks = determine_num_host_kv_blocks(config.cache, self.arch,
                                                               self.kv_dtype)
        self.host_kv_cache = (
            HostKVCache(self.kv_caches, self.num_host_kv_blocks, self.block_size)
            if self.num_host_kv_blocks else None
        )
        self.batch = InputBatch(
            max_num_reqs=config.scheduler.max_num_seqs,
            max_model_len=max_model_len,
            max_blocks_per_req=-(-max_model_len // self.block_size),
            vocab_size=self.arch.vocab_size,
            device=self.device,
        )
        if self.device.type == "cuda":
            self.batch.token_counts.allocate()  # reserved in the pool's sizing above
        self.decode_graphs = self._decode_graphs(self.kv_caches)
        if self.decode_graphs is not None:
            with torch.inference_mode():
                self.decode_graphs.capture()
        generator = torch.Generator(device=self.device).manual_seed(config.model.seed)
        self.sampler = Sampler(generator)
        self._pending_tokens = PendingTokens()
        self._unresolved: deque[RunnerStep] = deque()  # launched, result not taken, in order

    @torch.inference_mode()
    def _profile_reserved_bytes(self) -> int:
        """Device memory the KV pool must leave free, measured on a scratch cache before the
        real pool is sized: the largest peak of the forwards of the steps the backend names
        (`AttentionBackend.profiled_steps`: a full-budget prompt, and a step for each other
        way it attends a prefill), of the largest decode bucket's forward, and of what a
        step does after its forward (`_sampling_peak_bytes`); plus that decode peak again for
        the CUDA graphs' memory pool (unless `enforce_eager`), which stays allocated, the
        null block, and the penalties' token counts (`TokenCounts`, allocated once the pool
        is sized)."""
        scheduler = self.config.scheduler
        num_tokens = min(scheduler.max_num_batched_tokens, scheduler.max_model_len)
        max_bucket = max(self.decode_buckets, default=0)
        scratch = self._allocate_kv_caches(max(-(-num_tokens // self.block_size), max_bucket))
        prefill_peak = max(self._prefill_peak_bytes(scratch, step)
                           for step in self.attention.profiled_steps(num_tokens))
        decode_peak = self._decode_peak_bytes(scratch, max_bucket) if max_bucket else 0
        del scratch
        sampling_peak = self._sampling_peak_bytes(num_tokens, scheduler.max_num_seqs)
        torch.cuda.empty_cache()
        graphs_bytes = decode_peak if not self.config.model.enforce_eager else 0
        null_block_bytes = kv_block_bytes(self.arch, self.block_size, self.kv_dtype)
        token_counts_bytes = TokenCounts.num_bytes(scheduler.max_num_seqs, self.arch.vocab_size)
        return (max(prefill_peak, decode_peak, sampling_peak) + graphs_bytes + null_block_bytes
                + token_counts_bytes)

    def _prefill_peak_bytes(self, scratch: list[torch.Tensor], step: ProfiledStep) -> int:
        """The peak of a forward of `step`, one sequence over the scratch cache's blocks,
        which a context longer than the scratch reads again and again (its K/V are
        garbage either way)."""
        num_scratch_blocks = scratch[0].shape[1] // self.block_size
        num_blocks = -(-(step.context_len + step.query_len) // self.block_size)
        metadata = self.attention.build_metadata(
            np.array([step.query_len]), np.array([step.context_len]),
            (np.arange(num_blocks) % num_scratch_blocks)[None])
        input_ids = torch.zeros(step.query_len, dtype=torch.int64, device=self.device)
        positions = torch.from_numpy(metadata.positions).to(self.device)
        return _peak_bytes(self.device,
                           lambda: self.model(input_ids, positions, scratch, metadata))

    def _decode_peak_bytes(self, scratch: list[torch.Tensor], batch_size: int) -> int:
        graphs = self._decode_graphs(scratch, use_graphs=False)
        assert graphs is not None
        step = DecodeStep(input_ids=np.zeros(batch_size, dtype=np.int64),
                          positions=np.zeros(batch_size, dtype=np.int64),
                          slot_mapping=np.arange(batch_size) * self.block_size,
                          block_table=np.arange(batch_size)[:, None])
        return _peak_bytes(self.device, lambda: graphs.run(step))

    def _sampling_peak_bytes(self, num_tokens: int, num_rows: int) -> int:
        """The peak of what `_launch` does after a forward of `num_tokens` tokens, whose hidden
        states stay while the rest is freed: `num_rows` rows' sampling inputs with every
        filter, penalties, a grammar, a bias and the most logprobs
        (`SamplingMetadata.worst_case`), a chunk of prompt logprobs, then the logits and
        the sampler."""
        vocab_size = self.arch.vocab_size
        num_rows = min(num_rows, num_tokens)
        chunk_rows = min(prompt_logits_rows_per_chunk(vocab_size), num_tokens)
        sampler = Sampler(torch.Generator(device=self.device))  # the engine's stays unused

        def after_forward() -> object:
            hidden = torch.zeros((num_tokens, self.arch.hidden_size), dtype=self.dtype,
                                 device=self.device)
            metadata = SamplingMetadata.worst_case(num_rows, vocab_size, self.device)
            gather_logprobs(self.model.compute_logits(hidden[:chunk_rows]),
                            torch.zeros(chunk_rows, dtype=torch.int64, device=self.device),
                            min(MAX_LOGPROBS, vocab_size))
            return sampler(self.model.compute_logits(hidden[:num_rows]), metadata)

        return _peak_bytes(self.device, after_forward)

    def _decode_graphs(self, kv_caches: list[torch.Tensor], use_graphs: bool | None = None
                       ) -> DecodeGraphs | None:
        """Decode on static buffers over `kv_caches` (whose last block is the null block);
        None when the backend cannot. Graphs are captured on CUDA unless `enforce_eager`."""
        if not self.decode_buckets:
            return None
        if use_graphs is None:
            use_graphs = self.device.type == "cuda" and not self.config.model.enforce_eager
        null_block = kv_caches[0].shape[1] // self.block_size - 1
        buffers = StaticDecodeBuffers(
            max(self.decode_buckets), -(-self.config.scheduler.max_model_len // self.block_size),
            null_slot=null_block * self.block_size, device=self.device)
        return DecodeGraphs(
            self.attention,
            lambda input_ids, positions, metadata: self.model(input_ids, positions, kv_caches,
                                                              metadata),
            self.decode_buckets, buffers, use_graphs)

    @torch.inference_mode()
    def profile_prefill(self, lengths: Sequence[int]) -> list[tuple[int, float]]:
        """(length, seconds) of one whole-prompt prefill per length, the best of two runs.

        Runs on the KV pool, so it is called before any request owns a block; lengths beyond
        the pool are skipped.
        """
        capacity = self.num_kv_blocks * self.block_size
        return [(n, min(self._time_prefill(n) for _ in range(2)))
                for n in lengths if 0 < n <= capacity]

    @torch.inference_mode()
    def profile_kv_reload(self, lengths: Sequence[int]) -> list[tuple[int, float]]:
        """(length, seconds) of loading that many tokens' blocks from the host tier into the
        KV pool, the best of two runs; [] without a tier.

        Writes into the KV pool, so it is called before any request owns a block; lengths
        beyond either pool are skipped.
        """
        if self.host_kv_cache is None:
            return []
        capacity = min(self.num_kv_blocks, self.num_host_kv_blocks) * self.block_size
        return [(n, min(self._time_kv_reload(n) for _ in range(2)))
                for n in lengths if 0 < n <= capacity]

    def _time_kv_reload(self, num_tokens: int) -> float:
        assert self.host_kv_cache is not None
        num_blocks = -(-num_tokens // self.block_size)
        pairs = [(block_id, block_id) for block_id in range(num_blocks)]
        self._synchronize()
        started_s = time.perf_counter()
        self.host_kv_cache.load_blocks(pairs)
        self._synchronize()
        return time.perf_counter() - started_s

    def _time_prefill(self, num_tokens: int) -> float:
        num_blocks = -(-num_tokens // self.block_size)
        metadata = self.attention.build_metadata(np.array([num_tokens]), np.array([0]),
                                                 np.arange(num_blocks)[None])
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        self._synchronize()
        started_s = time.perf_counter()
        hidden = self.model(input_ids, torch.from_numpy(metadata.positions).to(self.device),
                            self.kv_caches, metadata)
        self.model.compute_logits(hidden[-1:])
        self._synchronize()
        return time.perf_counter() - started_s

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        """One cache per layer of `num_blocks` blocks plus the null block (no request's)."""
        shape = (2, (num_blocks + 1) * self.block_size, self.arch.num_key_value_heads,
                 self.arch.head_dim)
        return [torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
                for _ in range(self.arch.num_hidden_layers)]

    @property
    def prefers_async_scheduling(self) -> bool:
        """Whether launching the next step before taking this one's result pays: on CUDA
        `submit` returns while the device runs the step; on CPU the step runs inside it."""
        return self.device.type == "cuda"

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step to its end: `submit`, then its `result`."""
        return self.submit(scheduler_output).result()

    @torch.inference_mode()
    def submit(self, scheduler_output: SchedulerOutput) -> PendingStep:
        """Launches one step; its `result` gives one (possibly empty) token list per
        scheduled request. Results are taken in launch order (taking one takes the earlier
        ones first). The step's host-tier copies are all done when `submit` returns, even if
        no token was scheduled (the tier is used without async scheduling only)."""
        self.update_states(scheduler_output)
        transfers = scheduler_output.kv_transfers
        if self.host_kv_cache is None:
            if not transfers.is_empty:
                raise RuntimeError("the step carries host-tier copies but the runner has no "
                                 "host tier (kv_offload_gib is 0)")
            return self._launch(scheduler_output)
        started_s = time.perf_counter()
        self.host_kv_cache.copy_before_forward(transfers)
        copy_time_s = time.perf_counter() - started_s
        output = self._launch(scheduler_output).result()
        started_s = time.perf_counter()
        self.host_kv_cache.finish()
        output.kv_copy_time_s = copy_time_s + time.perf_counter() - started_s
        return CompletedStep(output)

    def _launch(self, scheduler_output: SchedulerOutput) -> PendingStep:
        """The forward, sampling and logprobs of the step (nothing if it schedules no token),
        enqueued on the device; complete at once when the step samples nothing."""
        if scheduler_output.is_empty:
            return CompletedStep(ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
        inputs = self.prepare_inputs(scheduler_output)
        hidden = self._forward(inputs)
        # Built while the device runs the forward; its copies do not wait for it.
        metadata = None
        if inputs.sampling_rows:
            metadata = self.batch.sampling_metadata(inputs.sampling_rows,
                                                    scheduler_output.grammar_bitmask)
        prompt_logprobs = self._prompt_logprobs(hidden, inputs.prompt_logprob_spans)
        if metadata is None:
            return CompletedStep(ModelRunnerOutput(
                req_ids=inputs.req_ids,
                sampled_token_ids=[[] for _ in inputs.req_ids],
                prompt_logprobs=[prompt_logprobs.get(req_id) for req_id in inputs.req_ids]
                if prompt_logprobs else None,
            ))
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        output = self.sampler(logits, metadata)
        if metadata.penalties is not None:  # else no sampling row counts its tokens
            self.batch.count_sampled(inputs.sampling_rows, output.sampled_token_ids)
        step = RunnerStep(
            req_ids=inputs.req_ids, sampling_req_ids=inputs.sampling_req_ids,
            sampled=output.sampled_token_ids,
            host_token_ids=self._to_host(output.sampled_token_ids),
            host_logprobs=None if output.logprobs is None else SampledLogprobs(
                token_ids=self._to_host(output.logprobs.token_ids),
                logprobs=self._to_host(output.logprobs.logprobs),
                sampled_ranks=self._to_host(output.logprobs.sampled_ranks)),
            logprob_counts=[self.batch.rows[row].sampling_params.logprobs
                            for row in inputs.sampling_rows],
            prompt_logprobs=prompt_logprobs, placed=[],
            ready=self._record_event(), resolve=self._resolve,
        )
        rows = np.array(inputs.sampling_rows, dtype=np.int64)
        positions = self.batch.append_placeholders(rows).tolist()
        for index, (req_id, position) in enumerate(
                zip(inputs.sampling_req_ids, positions, strict=True)):
            self._pending_tokens.add(req_id, position, step, index)
            step.placed.append((req_id, position, index))
        self._unresolved.append(step)
        return step

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` on its way to pinned host memory (on CPU, itself)."""
        if self.device.type != "cuda":
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor, non_blocking=True)

    def _record_event(self) -> torch.cuda.Event | None:
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _resolve(self, step: RunnerStep) -> ModelRunnerOutput:
        """Waits for `step`'s tokens (taking the steps launched before it first), fills in
        its placeholders and builds its output."""
        while self._unresolved and self._unresolved[0] is not step:
            self._unresolved[0].result()
        if self._unresolved:
            self._unresolved.popleft()
        if step.ready is not None:
            step.ready.synchronize()
        token_ids = step.host_token_ids.tolist()
        batch = self.batch
        for req_id, position, index in step.placed:
            if self._pending_tokens.settle(req_id, position, step):
                batch.set_token(batch.row_of[req_id], position, token_ids[index])
        sampled: dict[str, list[int]] = {req_id: [] for req_id in step.req_ids}
        for req_id, token_id in zip(step.sampling_req_ids, token_ids, strict=True):
            sampled[req_id] = [token_id]
        logprobs = self._per_request_logprobs(step) if step.host_logprobs is not None else {}
        return ModelRunnerOutput(
            req_ids=step.req_ids,
            sampled_token_ids=[sampled[req_id] for req_id in step.req_ids],
            logprobs=[logprobs.get(req_id) for req_id in step.req_ids] if logprobs else None,
            prompt_logprobs=[step.prompt_logprobs.get(req_id) for req_id in step.req_ids]
            if step.prompt_logprobs else None,
        )

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Applies the scheduler's deltas to the persistent batch."""
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self.batch.remove(req_id)
            self._pending_tokens.drop(req_id)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            self.batch.append_blocks(req_id, new_block_ids)
            self.batch.num_computed_tokens[self.batch.row_of[req_id]] = num_computed
        for new in scheduler_output.scheduled_new_reqs:
            self.batch.add(new)

    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> StepInputs:
        """Token ids, positions and attention metadata of the step, decodes first."""
        batch = self.batch
        num_scheduled = scheduler_output.num_scheduled_tokens
        scheduled_ids = list(num_scheduled)
        rows = np.array([batch.row_of[req_id] for req_id in scheduled_ids], dtype=np.int64)
        query_lens = np.array([num_scheduled[req_id] for req_id in scheduled_ids],
                              dtype=np.int64)
        # Decodes first, longest context first: the attention kernels dispatch the costliest
        # sequences first, and decodes of similar length sit together. Prompts with no cached
        # prefix come last, longest last: a backend that attends the long ones apart
        # (`triton-sdpa`) finds them together at the end.
        order = np.lexsort((query_lens, -batch.num_computed_tokens[rows], query_lens != 1))
        rows, query_lens = rows[order], query_lens[order]
        req_ids = [scheduled_ids[index] for index in order.tolist()]
        context_lens = batch.num_computed_tokens[rows]
        metadata = None
        if not self._fits_decode_graphs(query_lens):
            metadata = self.attention.build_metadata(query_lens, context_lens,
                                                     batch.block_table[rows])
        positions = (step_positions(query_lens, context_lens) if metadata is None
                     else metadata.positions)
        token_rows = np.repeat(rows, query_lens)
        input_ids = batch.token_ids[token_rows, positions]
        samples = context_lens + query_lens >= batch.num_tokens[rows]
        last_token_indices = np.cumsum(query_lens) - 1
        first_token_indices = last_token_indices - query_lens + 1
        spans = self._prompt_logprob_spans(req_ids, rows, context_lens, query_lens,
                                           first_token_indices)
        decode_step = None
        if metadata is None:
            table = batch.block_table[rows, : -(-int(positions.max() + 1) // self.block_size)]
            decode_step = DecodeStep(
                input_ids=input_ids, positions=positions,
                slot_mapping=slot_mapping(query_lens, positions, table, self.block_size),
                block_table=table)
        return StepInputs(
            req_ids=req_ids,
            input_ids=None if metadata is None else to_device(input_ids, self.device),
            positions=None if metadata is None else to_device(positions, self.device),
            metadata=metadata,
            decode_step=decode_step,
            logits_indices=to_device(last_token_indices[samples], self.device),
            sampling_rows=rows[samples].tolist(),
            sampling_req_ids=[req_id for req_id, s in zip(req_ids, samples, strict=True) if s],
            prompt_logprob_spans=spans,
            token_patch=self._token_patch(req_ids, context_lens, query_lens,
                                          first_token_indices),
        )

    def _token_patch(self, req_ids: list[str], context_lens: np.ndarray,
                     query_lens: np.ndarray, first_token_indices: np.ndarray
                     ) -> TokenPatch | None:
        """The step's input tokens that are placeholders (sampled by steps whose result is not
        taken yet), with their values gathered from those steps' device tensors."""
        if not self._pending_tokens:
            return None
        targets: dict[RunnerStep, tuple[list[int], list[int]]] = {}
        for index, req_id in enumerate(req_ids):
            pending = self._pending_tokens.of(req_id)
            if pending is None:
                continue
            start = int(context_lens[index])
            end = start + int(query_lens[index])
            for position, (step, sampled_index) in pending.items():
                if start <= position < end:
                    token_indices, sampled_indices = targets.setdefault(step, ([], []))
                    token_indices.append(int(first_token_indices[index]) + position - start)
                    sampled_indices.append(sampled_index)
        if not targets:
            return None
        return TokenPatch(
            token_indices=to_device(np.concatenate([t for t, _ in targets.values()]),
                                    self.device, np.int64),
            values=torch.cat([
                step.sampled[to_device(np.array(indices), self.device, np.int64)]
                for step, (_, indices) in targets.items()]),
        )

    def _fits_decode_graphs(self, query_lens: np.ndarray) -> bool:
        """Whether the step runs on the static decode buffers: decodes only, within a bucket."""
        return (self.decode_graphs is not None and bool((query_lens == 1).all())
                and bucket_for(len(query_lens), self.decode_buckets) is not None)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states [tokens, hidden_size] of the step."""
        if inputs.decode_step is not None:
            assert self.decode_graphs is not None
            return self.decode_graphs.run(inputs.decode_step, inputs.token_patch)
        assert inputs.input_ids is not None and inputs.positions is not None
        assert inputs.metadata is not None
        if inputs.token_patch is not None:
            inputs.token_patch.apply(inputs.input_ids)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)

    def _prompt_logprob_spans(
        self, req_ids: list[str], rows: np.ndarray, context_lens: np.ndarray,
        query_lens: np.ndarray, first_token_indices: np.ndarray,
    ) -> list[PromptLogprobSpan]:
        """The step's positions that predict a prompt token, of the requests that ask for
        prompt logprobs. A row that has sampled a token already returned them all (the step
        that finished its prompt did), so a request resumed after that computes none."""
        batch = self.batch
        spans = []
        for index, row in enumerate(rows.tolist()):
            state = batch.rows[row]
            if (state.sampling_params.prompt_logprobs is None
                    or batch.num_tokens[row] > state.num_prompt_tokens):
                continue
            context_len = int(context_lens[index])
            num_positions = min(int(query_lens[index]), state.num_prompt_tokens - 1 - context_len)
            if num_positions > 0:
                spans.append(PromptLogprobSpan(
                    req_id=req_ids[index], row=row,
                    first_token_index=int(first_token_indices[index]),
                    start_index=context_len + 1, num_positions=num_positions,
                ))
        return spans

    def _prompt_logprobs(
        self, hidden: torch.Tensor, spans: list[PromptLogprobSpan]
    ) -> dict[str, PromptLogprobs]:
        """Logprobs of the raw distribution for each span's prompt tokens, with as many top
        alternatives as its request asks for."""
        if not spans:
            return {}
        num_tops = [self.batch.rows[span.row].sampling_params.prompt_logprobs or 0
                    for span in spans]
        gathered = self._gather_prompt_logprobs(hidden, spans, max(num_tops))
        token_ids = gathered.token_ids.tolist()
        values = gathered.logprobs.tolist()
        ranks = gathered.sampled_ranks.tolist()
        result = {}
        offset = 0
        for span, num_top in zip(spans, num_tops, strict=True):
            result[span.req_id] = PromptLogprobs(start_index=span.start_index, entries=[
                TokenLogprobs(token_id=token_ids[i][0], logprob=values[i][0], rank=ranks[i],
                              top_token_ids=token_ids[i][1 : 1 + num_top],
                              top_logprobs=values[i][1 : 1 + num_top])
                for i in range(offset, offset + span.num_positions)
            ])
            offset += span.num_positions
        return result

    def _gather_prompt_logprobs(
        self, hidden: torch.Tensor, spans: list[PromptLogprobSpan], num_top: int
    ) -> SampledLogprobs:
        """The spans' positions in order, each with its prompt token as the "sampled" one;
        logits are computed `PROMPT_LOGITS_CHUNK_BYTES` at a time."""
        token_indices = np.concatenate([
            np.arange(span.first_token_index, span.first_token_index + span.num_positions)
            for span in spans])
        targets = np.concatenate([
            self.batch.token_ids[span.row, span.start_index : span.start_index + span.num_positions]
            for span in spans])
        rows_per_chunk = prompt_logits_rows_per_chunk(self.arch.vocab_size)
        parts = []
        for begin in range(0, len(token_indices), rows_per_chunk):
            end = begin + rows_per_chunk
            logits = self.model.compute_logits(
                hidden[to_device(token_indices[begin:end], self.device)])
            parts.append(gather_logprobs(
                logits, to_device(targets[begin:end], self.device), num_top))
        return SampledLogprobs(
            token_ids=torch.cat([part.token_ids for part in parts]),
            logprobs=torch.cat([part.logprobs for part in parts]),
            sampled_ranks=torch.cat([part.sampled_ranks for part in parts]),
        )

    def _per_request_logprobs(self, step: RunnerStep) -> dict[str, list[TokenLogprobs]]:
        """The sampled tokens' logprobs of the requests of `step` that asked for them."""
        assert step.host_logprobs is not None
        token_ids = step.host_logprobs.token_ids.tolist()
        values = step.host_logprobs.logprobs.tolist()
        ranks = step.host_logprobs.sampled_ranks.tolist()
        result = {}
        for index, (req_id, num_top) in enumerate(
            zip(step.sampling_req_ids, step.logprob_counts, strict=True)
        ):
            if num_top is None:
                continue
            result[req_id] = [TokenLogprobs(
                token_id=token_ids[index][0], logprob=values[index][0], rank=ranks[index],
                top_token_ids=token_ids[index][1 : 1 + num_top],
                top_logprobs=values[index][1 : 1 + num_top],
            )]
        return result


def prompt_logits_rows_per_chunk(vocab_size: int) -> int:
    """Rows of float32 logits computed at once for prompt logprobs."""
    return max(1, PROMPT_LOGITS_CHUNK_BYTES // (4 * vocab_size))


def _peak_bytes(device: torch.device, run: Callable[[], object]) -> int:
    """Device memory `run` allocates at its peak beyond what was allocated before it."""
    torch.cuda.synchronize(device)
    baseline = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - baseline
