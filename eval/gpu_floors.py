"""What a GPU's datasheet allows a decoder's steps and runs: the memory and compute floors.

A step cannot take less than the bytes it must read over the card's memory bandwidth, nor
less than its multiply-adds over the card's peak rate; its floor is the larger of the two
(`Floor.lower_s`). No kernel, schedule or overlap beats it, for an engine that computes one
token a sequence a decode step (no speculative decoding), at the datasheet's rates, with
attention and the LM head in 16 bits. A figure measured on a card is judged against that
card's own floor (`measured / floor` is a ratio of one card's figures), which is how a run
on an H200 can be read while issue 35's targets were set on an H100.

What is counted (Llama-style decoders, `ModelShape.from_config`):
- bytes: every projection's weights and the LM head's (the embedding gives only the step's
  rows), each a step reads once; the K/V of every cached token each sequence reads once;
- FLOPs: 2 a weight a token through the projections (the LM head only for the tokens whose
  logits a step computes: a decode's, a prompt's last), and attention's two products, 4
  a query head dimension a key, over the causal pairs of a prompt and a decode's context.
Norms, rotary, activations and the writes of new K/V are left out: a floor may only be low.

Cards are the SXM parts' datasheet figures (dense bf16 and fp8 tensor rates, HBM
bandwidth); `card_of` knows a device by the name torch reports.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

CardName = Literal["h100-sxm", "h200"]


@dataclass(frozen=True)
class Card:
    """A GPU's datasheet: HBM bandwidth (bytes/s) and dense tensor-core rates (FLOP/s)."""

    name: str
    memory_bytes_per_s: float
    bf16_flops_per_s: float
    fp8_flops_per_s: float


CARDS: dict[CardName, Card] = {
    "h100-sxm": Card("NVIDIA H100 SXM 80GB", 3.35e12, 989.4e12, 1978.9e12),
    "h200": Card("NVIDIA H200 SXM 141GB", 4.8e12, 989.4e12, 1978.9e12),
}


def card_of(device_name: str) -> Card | None:
    """The card torch names `device_name` (`torch.cuda.get_device_name()`), or None for one
    not listed (an H100 PCIe or NVL has other figures)."""
    if "MIG" in device_name:  # a slice: a part of the card's SMs and bandwidth
        return None
    if device_name.startswith("NVIDIA H100 80GB HBM3"):
        return CARDS["h100-sxm"]
    if device_name.startswith("NVIDIA H200") and "NVL" not in device_name:
        return CARDS["h200"]
    return None


@dataclass(frozen=True)
class ModelShape:
    """The counts of a decoder that its floors need."""

    num_layers: int
    hidden_size: int
    q_dim: int  # query heads x head dim
    layer_params: int  # the projections' weights, all layers
    head_params: int  # the LM head's weights
    kv_values_per_token: int  # K and V values a token keeps, all layers

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        """From a Hugging Face config.json's fields (Llama, Qwen2 and SmolLM2 name them
        alike; without `num_key_value_heads`, one KV head a query head)."""
        hidden = config["hidden_size"]
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads", heads)
        head_dim = config.get("head_dim") or hidden // heads
        layers = config["num_hidden_layers"]
        q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
        projections = hidden * (q_dim + 2 * kv_dim) + q_dim * hidden \
            + 3 * hidden * config["intermediate_size"]
        return cls(num_layers=layers, hidden_size=hidden, q_dim=q_dim,
                   layer_params=layers * projections,
                   head_params=config["vocab_size"] * hidden,
                   kv_values_per_token=layers * 2 * kv_dim)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelShape:
        """From a config.json file."""
        return cls.from_config(json.loads(Path(path).read_text()))


@dataclass(frozen=True)
class Precision:
    """Bytes a value of the projections' weights, of the LM head's (and the activations')
    and of the KV cache; whether the projections multiply at the fp8 rate."""

    weight_bytes: float = 2.0
    head_bytes: float = 2.0
    kv_bytes: float = 2.0
    fp8_products: bool = False

    @classmethod
    def of_run(cls, quantization: str, kv_cache_dtype: str) -> Precision:
        """A 16-bit model's run, from its report: `quantization` none or fp8 (the projections'
        weights in float8), `kv_cache_dtype` as the flag gives it (auto or fp8) or a torch
        dtype's name (float8 ones take a byte)."""
        fp8_weights = quantization == "fp8"
        fp8_cache = kv_cache_dtype == "fp8" or kv_cache_dtype.startswith("float8")
        return cls(weight_bytes=1.0 if fp8_weights else 2.0, kv_bytes=1.0 if fp8_cache else 2.0,
                   fp8_products=fp8_weights)


@dataclass(frozen=True)
class Floor:
    """Seconds the bytes take at the card's bandwidth, and the FLOPs at its peak rates."""

    memory_s: float
    compute_s: float

    @property
    def lower_s(self) -> float:
        """The floor: neither can take less, and both at once cannot beat the larger."""
        return max(self.memory_s, self.compute_s)


@dataclass(frozen=True)
class WorkloadCounts:
    """What an offline run of prompts and forced output lengths must compute and read,
    whatever its schedule (`counts_of`)."""

    prompt_tokens: int
    prompt_attention_pairs: int  # causal (query, key) pairs of the prompts
    decode_tokens: int  # output tokens after each request's first (sampled by its prefill)
    decode_context_tokens: int  # keys the decodes attend, summed (each its own among them)
    min_decode_steps: int  # the longest output's decodes, one a step
    num_requests: int

    @property
    def output_tokens(self) -> int:
        """Every request's first token (its prompt step's) and its decodes'."""
        return self.decode_tokens + self.num_requests


def counts_of(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> WorkloadCounts:
    """The counts of requests with these prompt and output lengths (each output at least 1:
    a request's first token comes from its prompt's step)."""
    if len(prompt_lens) != len(output_lens) or not prompt_lens:
        raise ValueError("give one output length for each of at least one prompt")
    if min(prompt_lens) < 1 or min(output_lens) < 1:
        raise ValueError("prompt and output lengths must be at least 1")
    decode_context = 0
    for prompt, output in zip(prompt_lens, output_lens, strict=True):
        # Decode k (1 .. output-1) attends the prompt and k tokens: prompt + k keys.
        decodes = output - 1
        decode_context += decodes * prompt + decodes * (decodes + 1) // 2
    return WorkloadCounts(
        prompt_tokens=sum(prompt_lens),
        prompt_attention_pairs=sum(length * (length + 1) // 2 for length in prompt_lens),
        decode_tokens=sum(output_lens) - len(output_lens),
        decode_context_tokens=decode_context,
        min_decode_steps=max(output_lens) - 1,
        num_requests=len(prompt_lens),
    )


def step_floor(model: ModelShape, card: Card, precision: Precision,
               sequences: Sequence[tuple[int, int]]) -> Floor:
    """A step of `sequences`, each `(query_len, context_len)`: `query_len` new tokens after
    `context_len` cached ones (a decode: 1 after its context; a prompt: its tokens after 0).
    The weights are read once, each sequence's cached K/V once, and the logits of each
    sequence's last token computed."""
    if not sequences or min(query for query, _ in sequences) < 1:
        raise ValueError("a step has at least one sequence of at least one new token")
    cached = sum(context for _, context in sequences)
    pairs = sum(query * context + query * (query + 1) // 2 for query, context in sequences)
    tokens = sum(query for query, _ in sequences)
    bytes_read = (_weight_bytes(model, precision) + tokens * model.hidden_size * 2
                  + cached * model.kv_values_per_token * precision.kv_bytes)
    return Floor(
        memory_s=bytes_read / card.memory_bytes_per_s,
        compute_s=_linear_s(model, card, precision, tokens, len(sequences))
        + _attention_flops(model, pairs) / card.bf16_flops_per_s)


def run_floor(model: ModelShape, card: Card, precision: Precision,
              counts: WorkloadCounts) -> Floor:
    """An offline run of `counts`: at least `min_decode_steps` steps, each reading the
    weights; every decode reading its cached tokens' K/V (its own new token's it has);
    every token through the projections."""
    cached_tokens = counts.decode_context_tokens - counts.decode_tokens
    kv_bytes = cached_tokens * model.kv_values_per_token * precision.kv_bytes
    weight_bytes = counts.min_decode_steps * _weight_bytes(model, precision)
    logits_rows = counts.num_requests + counts.decode_tokens
    tokens = counts.prompt_tokens + counts.decode_tokens
    return Floor(
        memory_s=(weight_bytes + kv_bytes) / card.memory_bytes_per_s,
        compute_s=_linear_s(model, card, precision, tokens, logits_rows)
        + _attention_flops(model, counts.prompt_attention_pairs + counts.decode_context_tokens)
        / card.bf16_flops_per_s)


def _weight_bytes(model: ModelShape, precision: Precision) -> float:
    """Bytes of the weights a step reads: every projection's and the LM head's."""
    return model.layer_params * precision.weight_bytes + model.head_params * precision.head_bytes


def _linear_s(model: ModelShape, card: Card, precision: Precision, tokens: int,
              logits_rows: int) -> float:
    """Seconds of the projections over `tokens` rows and the LM head over `logits_rows`."""
    rate = card.fp8_flops_per_s if precision.fp8_products else card.bf16_flops_per_s
    return (2 * model.layer_params * tokens / rate
            + 2 * model.head_params * logits_rows / card.bf16_flops_per_s)


def _attention_flops(model: ModelShape, pairs: int) -> float:
    """QK^T and PV over `pairs` (query token, key) pairs, every layer and query head."""
    return 4 * pairs * model.q_dim * model.num_layers
