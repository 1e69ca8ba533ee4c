"""The model families pdcluster serves, by HF ``model_type``: one :class:`Family` each.

A family module (``engine/model/families/<family>.py``) declares its HF config mapping
(``arch``: HF config object -> :class:`~common.model_arch.DecoderArch`) and registers it
with :func:`register_family`; that is the one place to add a family. The HF config is
read with ``transformers.AutoConfig``, so every default and legacy field spelling is
HF's own.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.model_arch import DecoderArch, RopeSpec
from common.model_config import ConfigError


@dataclass(frozen=True)
class Family:
    """One model family.

    Attributes:
        name: registry name (``"llama"``, ``"qwen3"``...).
        model_types: the HF ``model_type`` values it serves.
        architectures: the HF ``architectures`` (causal-LM classes) it serves.
        arch: HF config object -> the family's :class:`DecoderArch`; raises
            ``ConfigError`` for a feature the family's config turns on that the engine lacks.
        features: one line for the supported-models listing.
    """

    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    arch: Callable[[Any], DecoderArch]
    features: str = ""


_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Serve ``family``'s model types (a later registration of a model type replaces the earlier)."""
    for t in family.model_types:
        _FAMILIES[t] = family
    return family


def families() -> list[Family]:
    """The registered families, each once, in registration order."""
    return list(dict.fromkeys(_FAMILIES.values()))


def supported_architectures() -> list[str]:
    """Every HF architecture name a registered family serves."""
    return [a for f in families() for a in f.architectures]


def family_for(config: dict) -> Family:
    """The family serving an HF ``config.json`` (as a dict).

    Raises:
        ConfigError: its ``model_type`` / ``architectures`` are not served; the message
            names them and lists the supported architectures.
    """
    model_type = config.get("model_type")
    archs = list(config.get("architectures") or [])
    family = _FAMILIES.get(model_type)
    if family is None or (archs and not set(archs) & set(family.architectures)):
        named = ", ".join(archs) or "(no architectures field)"
        raise ConfigError(f"unsupported model architecture {named} (model_type {model_type!r}); "
                          f"supported: {', '.join(supported_architectures())}")
    return family


def load_arch(folder: str | Path) -> DecoderArch:
    """The :class:`DecoderArch` of the HF model folder ``folder`` (its ``config.json``).

    Raises:
        ConfigError: an unsupported architecture (:func:`family_for`) or a feature of it
            the engine lacks (an unknown RoPE scaling, attention logit soft-capping...).
        ValueError: ``config.json`` that ``transformers`` rejects.
    """
    from transformers import AutoConfig

    folder = Path(folder)
    family = family_for(json.loads((folder / "config.json").read_text()))
    return family.arch(AutoConfig.from_pretrained(str(folder)))


# ---- shared pieces of the HF config mappings ---------------------------------------------

def rope_spec(hf: Any, params: dict | None = None) -> RopeSpec:
    """The :class:`RopeSpec` of HF ``rope_parameters`` (``params``; default the config's own,
    already standardised by ``transformers``).

    Raises:
        ConfigError: partial rotary embeddings, or a RoPE kind the engine lacks.
    """
    p = dict(hf.rope_parameters if params is None else params)
    if float(p.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError(f"partial_rotary_factor {p['partial_rotary_factor']} is not supported")
    kind = p.get("rope_type", p.get("type", "default"))
    return RopeSpec(
        kind=kind, theta=float(p["rope_theta"]), max_position=int(hf.max_position_embeddings),
        factor=None if p.get("factor") is None else float(p["factor"]),
        original_max_position=p.get("original_max_position_embeddings"),
        low_freq_factor=float(p.get("low_freq_factor", 1.0)), high_freq_factor=float(p.get("high_freq_factor", 4.0)),
        beta_fast=float(p.get("beta_fast") or 32), beta_slow=float(p.get("beta_slow") or 1),
        attention_factor=p.get("attention_factor"), mscale=p.get("mscale"), mscale_all_dim=p.get("mscale_all_dim"),
        truncate=bool(p.get("truncate", True)),
    )


def layer_windows(hf: Any) -> tuple[int | None, ...]:
    """Per-layer sliding windows: from HF ``layer_types`` (``sliding_attention`` layers get
    ``sliding_window``), or ``sliding_window`` on every layer when the config has no
    ``layer_types`` (Mistral); empty when no layer slides.

    Raises:
        ConfigError: a layer type other than full or sliding attention.
    """
    window = getattr(hf, "sliding_window", None)
    types = getattr(hf, "layer_types", None)
    if types is None:
        return (int(window),) * hf.num_hidden_layers if window else ()
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ConfigError(f"layer types {unknown} are not supported (full_attention, sliding_attention)")
    windows = tuple(int(window) if t == "sliding_attention" and window else None for t in types)
    return windows if any(w is not None for w in windows) else ()
