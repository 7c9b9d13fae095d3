"""`continuum bench forward`: our model code against transformers' forward, same shapes.

Measures, for each implementation:
- prefill throughput: `--prefill-batch` prompts of `--prefill-len` tokens in one forward;
- batched decode throughput: `--batch-size` sequences, each with `--context-len` tokens
  already cached, advanced by `--decode-steps` single-token steps.

Ours runs exactly as the model runner does (flattened batch, paged KV cache, attention
metadata built every step, logits for the last token of each sequence only). Transformers runs
its own `forward` with its own KV cache (`DynamicCache`) and `logits_to_keep=1`. Contexts are
prefilled once, untimed; each timed decode run starts again from them. Weights are random
(timing does not depend on their values; `--shape qwen2.5-0.5b` uses that model's shapes).

Each implementation is measured in its own fresh process, alternating over `--rounds`: in one
process, whichever model was loaded first ran its matmuls measurably slower (up to 10% on this
2-core machine), which would bias a same-process comparison.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.bench.report import emit
from engine.config import ModelConfig
from engine.model.attention import build_attention_metadata
from engine.model.directory import resolve_model_dir
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import load_model, resolve_device, resolve_dtype

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "hidden_act": "silu",
    },
}
IMPLEMENTATIONS = ("ours", "transformers")
_SHAPE_ARGS = ("prefill_batch", "prefill_len", "batch_size", "context_len", "decode_steps")
_BLOCK_SIZE = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="'tiny' or a local HF directory")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="use a known model's shapes with random weights instead of --model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--prefill-batch", type=int, default=4)
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--context-len", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed runs per process; the median is kept")
    parser.add_argument("--rounds", type=int, default=2,
                        help="fresh processes per implementation; the median is kept")
    parser.add_argument("--impl", choices=("both", *IMPLEMENTATIONS), default="both",
                        help="measure one implementation in this process (used by 'both')")
    parser.add_argument("--json", dest="json_path", default=None, help="write results here")


def main(args: argparse.Namespace) -> int:
    results = compare(args) if args.impl == "both" else measure(args)
    emit(f"forward pass, {results['model']} ({results['dtype']}, {results['device']})",
         results, args.json_path)
    return 0


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """Medians over `--rounds` fresh processes per implementation, in alternating order."""
    samples: dict[str, list[dict[str, Any]]] = {impl: [] for impl in IMPLEMENTATIONS}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            order = IMPLEMENTATIONS if round_index % 2 == 0 else IMPLEMENTATIONS[::-1]
            for impl in order:
                path = Path(scratch) / f"{impl}-{round_index}.json"
                subprocess.run([sys.executable, "-m", "engine.cli", "bench", "forward",
                                *_forwarded_flags(args), "--impl", impl, "--json", str(path)],
                               check=True, capture_output=True, text=True)
                samples[impl].append(json.loads(path.read_text()))
    first = samples["ours"][0]
    results: dict[str, Any] = {key: first[key] for key in ("model", "dtype", "device", "threads")}
    for impl, runs in samples.items():
        for phase in ("prefill", "decode"):
            results[f"{impl}_{phase}_tok_s"] = statistics.median(
                run[f"{phase}_tok_s"] for run in runs)
    for phase in ("decode", "prefill"):
        results[f"{phase}_speedup"] = (
            results[f"ours_{phase}_tok_s"] / results[f"transformers_{phase}_tok_s"])
    results.update({key: getattr(args, key) for key in (*_SHAPE_ARGS, "repeats", "rounds")})
    return results


def _forwarded_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--model", args.model, "--dtype", args.dtype, "--device", args.device,
             "--repeats", str(args.repeats)]
    if args.shape is not None:
        flags += ["--shape", args.shape]
    for key in _SHAPE_ARGS:
        flags += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return flags


@torch.inference_mode()
def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Prefill and decode throughput of one implementation, in this process."""
    torch.manual_seed(0)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = _model_dir(args, Path(scratch))
        if args.impl == "ours":
            max_len = max(args.prefill_len, args.context_len + args.decode_steps + 1)
            model = load_model(ModelConfig(model=model_dir, load_format="dummy"), device, dtype,
                               max_len)
            timed = {"prefill": _our_prefill(model, args, device),
                     "decode": _our_decode(model, args, device)}
        else:
            model = _transformers_model(model_dir, device, dtype)
            timed = {"prefill": _hf_prefill(model, args, device),
                     "decode": _hf_decode(model, args, device)}
    seconds = _interleaved_medians_s(timed, args.repeats)
    return {
        "model": args.shape or args.model, "impl": args.impl,
        "dtype": str(dtype).removeprefix("torch."), "device": device.type,
        "threads": torch.get_num_threads(),
        "prefill_tok_s": args.prefill_batch * args.prefill_len / seconds["prefill"],
        "decode_tok_s": args.batch_size * args.decode_steps / seconds["decode"],
    }


def _model_dir(args: argparse.Namespace, scratch: Path) -> str:
    if args.shape is None:
        return args.model
    (scratch / "config.json").write_text(json.dumps(SHAPES[args.shape]))
    return str(scratch)


def _transformers_model(model_dir: str, device: torch.device, dtype: torch.dtype
                        ) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(resolve_model_dir(model_dir))
    return AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()


def _interleaved_medians_s(
    timed: dict[str, Callable[[], None]], repeats: int
) -> dict[str, float]:
    """Median wall time of each function after one warm-up run each.

    Repeats run round-robin, so slow drift of a shared machine (other load, thermal state)
    affects both implementations alike instead of whichever ran second.
    """
    for function in timed.values():
        function()
    samples: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(repeats):
        for name, function in timed.items():
            start = time.perf_counter()
            function()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


class _PagedState:
    """A paged KV cache holding `num_seqs` sequences in consecutive blocks."""

    def __init__(self, model: LlamaForCausalLM, num_seqs: int, max_len: int,
                 device: torch.device):
        arch = model.arch
        self.blocks_per_seq = -(-max_len // _BLOCK_SIZE)
        num_slots = num_seqs * self.blocks_per_seq * _BLOCK_SIZE
        self.dtype = model.lm_head.weight.dtype
        self.kv_caches = [
            torch.zeros((2, num_slots, arch.num_key_value_heads, arch.head_dim),
                        dtype=self.dtype, device=device)
            for _ in range(arch.num_hidden_layers)
        ]
        self.block_table = np.arange(num_seqs * self.blocks_per_seq).reshape(num_seqs, -1)
        self.model, self.device = model, device

    def forward(self, input_ids: torch.Tensor, query_lens: np.ndarray,
                context_lens: np.ndarray) -> torch.Tensor:
        """What the runner does per step: metadata, forward, last-token logits."""
        positions, metadata = build_attention_metadata(
            query_lens, context_lens, self.block_table, _BLOCK_SIZE, self.device,
            self.model.arch.sliding_window, self.dtype)
        hidden = self.model(input_ids, torch.from_numpy(positions).to(self.device),
                            self.kv_caches, metadata)
        last = torch.from_numpy(np.cumsum(query_lens) - 1).to(self.device)
        return self.model.compute_logits(hidden[last])


def _random_ids(vocab_size: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.randint(0, vocab_size, shape, device=device)


def _our_prefill(model: LlamaForCausalLM, args: argparse.Namespace,
                 device: torch.device) -> Callable[[], None]:
    state = _PagedState(model, args.prefill_batch, args.prefill_len, device)
    ids = _random_ids(model.arch.vocab_size, (args.prefill_batch * args.prefill_len,), device)
    lens = np.full(args.prefill_batch, args.prefill_len)
    return lambda: _sync(state.forward(ids, lens, np.zeros_like(lens)))


def _our_decode(model: LlamaForCausalLM, args: argparse.Namespace,
                device: torch.device) -> Callable[[], None]:
    batch = args.batch_size
    state = _PagedState(model, batch, args.context_len + args.decode_steps + 1, device)
    ids = _random_ids(model.arch.vocab_size, (batch * args.context_len,), device)
    state.forward(ids, np.full(batch, args.context_len), np.zeros(batch, dtype=np.int64))
    first_ids = _random_ids(model.arch.vocab_size, (batch,), device)

    def decode() -> None:
        next_ids = first_ids
        for step in range(args.decode_steps):
            context = np.full(batch, args.context_len + step)
            next_ids = state.forward(next_ids, np.ones(batch, dtype=np.int64), context).argmax(-1)
        _sync(next_ids)
    return decode


def _hf_prefill(model: torch.nn.Module, args: argparse.Namespace,
                device: torch.device) -> Callable[[], None]:
    ids = _random_ids(model.config.vocab_size, (args.prefill_batch, args.prefill_len), device)
    return lambda: _sync(model(ids, logits_to_keep=1).logits)


def _hf_decode(model: torch.nn.Module, args: argparse.Namespace,
               device: torch.device) -> Callable[[], None]:
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    cache = DynamicCache(config=model.config)
    model(_random_ids(vocab, (args.batch_size, args.context_len), device),
          past_key_values=cache, use_cache=True, logits_to_keep=1)
    first_ids = _random_ids(vocab, (args.batch_size, 1), device)

    def decode() -> None:
        extra = cache.get_seq_length() - args.context_len
        if extra:
            cache.crop(-extra)  # a negative count removes that many tokens
        next_ids = first_ids
        for _ in range(args.decode_steps):
            logits = model(next_ids, past_key_values=cache, use_cache=True,
                           logits_to_keep=1).logits
            next_ids = logits[:, -1].argmax(-1, keepdim=True)
        _sync(next_ids)
    return decode


def _sync(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
