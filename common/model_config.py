"""The served model's dimensions as read from its HF ``config.json`` (torch-free).

The router reads it for the vocabulary size, the context limit and the EOS ids; the
engine builds the model from it plus its family's layer differences
(:mod:`engine.model.families`, which also decides which architectures are supported).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class ConfigError(ValueError):
    """A configuration value is out of its allowed range."""


class FieldError(ConfigError):
    """One field of a config out of its range: ``field`` (its name), ``rule`` (what it must be,
    e.g. ``"must be >= 0"``) and ``value``; reads ``"<field> <rule>, got <value>"``.

    A layer that set the field from something else names that instead with :meth:`renamed`
    (the command line: the flag, e.g. ``--timeout-s must be > 0, got -5``).
    """

    def __init__(self, field: str, rule: str, value: object) -> None:
        shown = f"{value:g}" if isinstance(value, float) else repr(value) if isinstance(value, str) else value
        super().__init__(f"{field} {rule}, got {shown}")
        self.field, self.rule, self.value = field, rule, value

    def __reduce__(self):  # pickled (e.g. raised in a Ray actor) with its three parts, not the message
        return type(self), (self.field, self.rule, self.value)

    def renamed(self, names: dict[str, str]) -> FieldError:
        """This error with its field called ``names[field]`` (itself when ``names`` lacks the field)."""
        return FieldError(names[self.field], self.rule, self.value) if self.field in names else self


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions of a decoder-only transformer, the fields every HF ``config.json`` of
    one names alike (the family-specific ones are the engine's, see
    :mod:`engine.model.families`).

    Read from an HF ``config.json`` with :meth:`from_hf_folder`. ``max_context_len``:
    tokens a sequence may reach when RoPE scaling extends the context past
    ``max_position_embeddings`` (``dynamic``: ``factor`` times it); None = not extended.
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
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    model_type: str = "llama"
    max_context_len: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"{f} must be positive, got {getattr(self, f)}")

    @property
    def context_len(self) -> int:
        """The longest sequence (prompt + output, tokens) the model takes."""
        return self.max_context_len or self.max_position_embeddings

    @classmethod
    def from_hf_folder(cls, path: str | Path, name: str | None = None) -> "ModelConfig":
        """Build from ``path/config.json`` (+ ``generation_config.json`` for EOS ids).

        Whether the architecture is supported is the engine's call
        (:func:`engine.model.families.load_arch`), not this reader's.

        Raises:
            ConfigError: a field missing from ``config.json`` or out of range.
        """
        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        try:
            return cls._from_hf_dict(cfg, path, name)
        except KeyError as exc:
            raise ConfigError(f"{path / 'config.json'} lacks {exc.args[0]!r}") from None

    @classmethod
    def _from_hf_dict(cls, cfg: dict, path: Path, name: str | None) -> "ModelConfig":
        eos: list[int] = []
        for src in (cfg, _read_json(path / "generation_config.json")):
            e = src.get("eos_token_id")
            for x in (e if isinstance(e, list) else [e]):
                if x is not None and int(x) not in eos:
                    eos.append(int(x))
        heads = cfg["num_attention_heads"]
        max_pos = cfg.get("max_position_embeddings", 4096)
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
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=tuple(eos),
            bos_token_id=cfg.get("bos_token_id"),
            model_type=str(cfg.get("model_type", "")),
            max_context_len=_scaled_context(cfg, max_pos),
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K+V for one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def _scaled_context(cfg: dict, max_pos: int) -> int | None:
    """``dynamic`` RoPE scaling's context (``factor`` x ``max_position_embeddings``), else None.
    The scaling sits in ``rope_scaling`` (older configs) or ``rope_parameters`` (flat, or
    per layer type under ``full_attention``)."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if isinstance(rope.get("full_attention"), dict):
        rope = rope["full_attention"]
    if rope.get("rope_type", rope.get("type")) == "dynamic" and rope.get("factor"):
        return int(max_pos * float(rope["factor"]))
    return None


def _read_json(p: Path) -> dict:
    return json.loads(p.read_text()) if p.exists() else {}
