"""The served model's architecture as read from its HF ``config.json`` (torch-free).

The router reads it for the vocabulary size, the context limit and the EOS ids;
the engine builds the model from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class ConfigError(ValueError):
    """A configuration value is out of its allowed range."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2).

    Read from an HF ``config.json`` with :meth:`from_hf_folder`.
    """

    name: str
    path: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    rope_scaling: dict | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"{f} must be positive, got {getattr(self, f)}")

    @classmethod
    def from_hf_folder(cls, path: str | Path, name: str | None = None) -> "ModelConfig":
        """Build from ``path/config.json`` (+ ``generation_config.json`` for EOS ids).

        Raises:
            ConfigError: unsupported ``model_type`` or missing fields.
        """
        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        model_type = cfg.get("model_type")
        if model_type not in ("llama", "mistral", "qwen2"):
            raise ConfigError(f"unsupported model_type {model_type!r} (llama, mistral, qwen2)")
        eos: list[int] = []
        for src in (cfg, _read_json(path / "generation_config.json")):
            e = src.get("eos_token_id")
            for x in (e if isinstance(e, list) else [e]):
                if x is not None and int(x) not in eos:
                    eos.append(int(x))
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope_params.get("rope_type", "default")
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope_type != "default":
            scaling = dict(rope_params)
        heads = cfg["num_attention_heads"]
        return cls(
            name=name or cfg.get("_name_or_path") or path.name,
            path=str(path),
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            eos_token_ids=tuple(eos),
            bos_token_id=cfg.get("bos_token_id"),
            rope_scaling=scaling,
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K+V for one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def _read_json(p: Path) -> dict:
    return json.loads(p.read_text()) if p.exists() else {}
