"""What one model family changes in the shared decoder (torch-free data).

A family module (:mod:`engine.model.families`) maps an HF config to a
:class:`DecoderArch`; :mod:`engine.model.decoder` builds the layers from it. The
dimensions (hidden size, heads, layers, vocabulary) stay in
:class:`common.model_config.ModelConfig`, which every process reads. It lives in ``common``
because it travels in the worker config (:class:`serving.worker_config.WorkerConfig`), which
torch-free processes read too: ``pdcluster up`` reads it once and every worker builds from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.model_config import ConfigError

ROPE_KINDS = ("default", "linear", "dynamic", "llama3", "yarn")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")


@dataclass(frozen=True)
class RopeSpec:
    """One rotary embedding, as HF ``transformers`` computes it (``modeling_rope_utils``).

    Attributes:
        kind: ``"default"``, ``"linear"`` (positions / ``factor``), ``"dynamic"`` (NTK base
            grown with the sequence past ``max_position``), ``"llama3"`` (Llama 3.1
            wavelength-banded scaling) or ``"yarn"``.
        theta: the base wavelength (``rope_theta``).
        max_position: the model's ``max_position_embeddings`` (tokens; ``dynamic``'s
            threshold, ``yarn``'s default for the factor).
        factor: scaling factor (``linear``, ``dynamic``, ``llama3``, ``yarn``); None = yarn's
            ``max_position / original_max_position``.
        original_max_position: pretraining context (``llama3``, ``yarn``; tokens).
        low_freq_factor / high_freq_factor: ``llama3``'s band limits.
        beta_fast / beta_slow / attention_factor / mscale / mscale_all_dim / truncate: ``yarn``'s.
    """

    kind: str = "default"
    theta: float = 10000.0
    max_position: int = 4096
    factor: float | None = 1.0
    original_max_position: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ConfigError(f"rope scaling {self.kind!r} is not supported (supported: {', '.join(ROPE_KINDS)})")
        if self.theta <= 0 or self.max_position <= 0:
            raise ConfigError(f"rope_theta and max_position_embeddings must be positive, got "
                              f"{self.theta}, {self.max_position}")
        if self.kind in ("linear", "dynamic", "llama3") and not (self.factor and self.factor > 0):
            raise ConfigError(f"rope scaling {self.kind!r} needs a positive factor, got {self.factor}")
        if self.kind in ("llama3", "yarn") and not self.original_max_position:
            raise ConfigError(f"rope scaling {self.kind!r} needs original_max_position_embeddings")


@dataclass(frozen=True)
class DecoderArch:
    """A family's layer differences over the shared pre-norm decoder.

    Attributes:
        family: the family's registry name (``"llama"``, ``"qwen3"``, ``"gemma3"``...).
        rope: RoPE of the full-attention layers.
        local_rope: RoPE of the layers in ``local_layers`` (Gemma 3's sliding-attention
            layers and their own base); None = ``rope`` everywhere.
        local_layers: indices of the layers that use ``local_rope``.
        layer_windows: per layer, the sliding window in tokens (a query attends to itself
            and the ``window - 1`` tokens before it) or None for global attention; empty =
            every layer global.
        qkv_bias / o_bias / mlp_bias: biases of q/k/v, of o_proj, of the MLP projections.
        qk_norm: RMSNorm over ``head_dim`` of every query and key head before RoPE (Qwen3, Gemma 3).
        norm_offset: every RMSNorm scales by ``norm_offset + weight`` (Gemma: 1.0) and
            multiplies in float32 before casting back (Gemma) when non-zero.
        embed_scale: the token embeddings are multiplied by it (Gemma: ``sqrt(hidden_size)``).
        activation: the gated MLP's activation (``silu``, ``gelu_pytorch_tanh``, ``gelu``).
        sandwich_norm: Gemma's extra norms: attention and MLP outputs normed before the
            residual add, plus a pre-MLP norm (``pre_feedforward_layernorm``).
        attn_scale: softmax scale; None = ``head_dim ** -0.5``.
        final_logit_softcap: logits = ``cap * tanh(logits / cap)`` when set.

    Raises:
        ConfigError: an unknown activation or a window below 1.
    """

    family: str
    rope: RopeSpec
    local_rope: RopeSpec | None = None
    local_layers: tuple[int, ...] = ()
    layer_windows: tuple[int | None, ...] = ()
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    norm_offset: float = 0.0
    embed_scale: float = 1.0
    activation: str = "silu"
    sandwich_norm: bool = False
    attn_scale: float | None = None
    final_logit_softcap: float | None = None

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"activation {self.activation!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        for w in self.layer_windows:
            if w is not None and w < 1:
                raise ConfigError(f"sliding_window must be >= 1 token, got {w}")

    @classmethod
    def from_dict(cls, d: dict) -> "DecoderArch":
        """Inverse of :func:`dataclasses.asdict`, also after a JSON round trip (lists back to
        tuples): how a worker gets the arch ``pdcluster up`` read (:class:`serving.worker_config.WorkerConfig`).

        Raises:
            TypeError / ConfigError: the dict does not describe a valid arch.
        """
        local = d.get("local_rope")
        return cls(**{**d, "rope": RopeSpec(**d["rope"]), "local_rope": RopeSpec(**local) if local else None,
                      "local_layers": tuple(d.get("local_layers", ())),
                      "layer_windows": tuple(d.get("layer_windows", ()))})

    def window(self, layer: int) -> int | None:
        """Sliding window of ``layer`` in tokens, None = global attention."""
        return self.layer_windows[layer] if self.layer_windows else None

    def rope_for(self, layer: int) -> RopeSpec:
        """The RoPE that ``layer`` uses."""
        return self.local_rope if self.local_rope is not None and layer in self.local_layers else self.rope

    @property
    def sliding_windows(self) -> tuple[int, ...]:
        """The distinct sliding windows of the model, ascending (empty: all global)."""
        return tuple(sorted({w for w in self.layer_windows if w is not None}))
