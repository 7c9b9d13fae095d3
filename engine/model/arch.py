"""The architecture of a Llama-family checkpoint, read from its Hugging Face `config.json`.

One frozen description covers Llama 2/3, Mistral, Qwen2 and Qwen3: they differ only in the
flags below (QKV bias, q/k norm, RoPE scaling, sliding window, tied embeddings). Both the
older config layout (`rope_theta` + `rope_scaling`) and the newer one (`rope_parameters`) are
accepted. Anything we cannot run faithfully is rejected with a `ValueError` naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: `linear` divides positions by `factor`; `llama3` rescales
    low frequencies (wavelengths above `original_max_position_embeddings / low_freq_factor`)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelArch:
    """Shapes and flags of one decoder-only model; `head_dim` may differ from hidden/heads."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"config field {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_hidden_layers * self.kv_size * dtype_size

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelArch:
        """Parse a `config.json` dict; raises `ValueError` for unsupported architectures."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
            )
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config['hidden_act']!r}; only silu")
        hidden_size = config["hidden_size"]
        num_heads = config["num_attention_heads"]
        rope_theta, rope_scaling = _parse_rope(config)
        attention_bias = bool(config.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=config["vocab_size"],
            hidden_size=hidden_size,
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or hidden_size // num_heads,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type in ("llama", "mistral") and attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=_parse_sliding_window(config),
            eos_token_ids=_as_id_tuple(config.get("eos_token_id")),
        )


def _parse_rope(config: dict[str, Any]) -> tuple[float, RopeScaling]:
    params = dict(config.get("rope_parameters") or {})
    legacy = config.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return theta, RopeScaling()
    fields = {
        key: params[key]
        for key in ("factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings")
        if key in params
    }
    scaling = RopeScaling(rope_type=rope_type, **fields)
    if scaling.factor <= 0:
        raise ValueError(f"rope scaling factor must be positive, got {scaling.factor}")
    return theta, scaling


def _parse_sliding_window(config: dict[str, Any]) -> int | None:
    window = config.get("sliding_window")
    if config.get("model_type") in ("qwen2", "qwen3"):
        if not config.get("use_sliding_window", False):
            return None
        layer_types = set(config.get("layer_types") or ["sliding_attention"])
        if layer_types != {"sliding_attention"}:
            raise ValueError("models mixing sliding-window and full-attention layers are "
                             "not supported")
    return int(window) if window else None


def _as_id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)
