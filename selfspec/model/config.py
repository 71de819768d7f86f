"""Model architecture configuration, read from a Hugging Face `config.json`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    # Scaling parameters exactly as the checkpoint spells them (factor, low_freq_factor, ...).
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(
                f"unsupported rope_type {self.rope_type!r}: selfspec supports {', '.join(SUPPORTED_ROPE_TYPES)}"
            )


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Per layer: None for full attention, else the sliding-window width in tokens.
    sliding_windows: tuple[int | None, ...]
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        if len(self.sliding_windows) != self.num_layers:
            raise ModelLoadError("sliding_windows must name one entry per layer")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"unsupported model_type {model_type!r}: selfspec supports {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if cfg.get("mlp_bias"):
            raise ModelLoadError("mlp_bias=true is not supported (no llama/mistral/qwen2 release uses it)")
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        layers = cfg["num_hidden_layers"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=_rope_from_hf(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_windows=_sliding_windows_from_hf(cfg, model_type, layers),
            eos_token_ids=eos_ids,
        )


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older checkpoints write `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if rope_type in ("yarn", "llama3") and "original_max_position_embeddings" not in params:
        params["original_max_position_embeddings"] = cfg.get("max_position_embeddings", 2048)
    return RopeConfig(theta=float(theta), rope_type=rope_type, params=params)


def _sliding_windows_from_hf(cfg: dict[str, Any], model_type: str, layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if model_type == "qwen2":
        # Qwen2 slides only when asked to, and only from layer `max_window_layers` on.
        if not cfg.get("use_sliding_window", False):
            return (None,) * layers
        first = cfg.get("max_window_layers", layers)
        return tuple(window if i >= first else None for i in range(layers))
    return (window,) * layers
