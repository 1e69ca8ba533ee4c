"""Tiny random-initialised models of every served family, built with HF ``transformers``
configs and saved as safetensors folders (the method HF's own model tests use), plus
the engine and HF greedy continuations compared by the family tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

DIMS = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            rms_norm_eps=1e-6, max_position_embeddings=256, attn_implementation="eager")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

# family name -> (transformers config class, CausalLM class, config overrides)
FAMILIES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_hidden_layers=2, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama_yarn": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_hidden_layers=2, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})),
    "llama_dynamic": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_hidden_layers=2, max_position_embeddings=32, rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_hidden_layers=2, sliding_window=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        num_hidden_layers=3, use_sliding_window=True, sliding_window=8, max_window_layers=1,
        tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_hidden_layers=2)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=4, sliding_window=8, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])),
}


def build_tiny(family: str, out: Path, vocab_size: int = 256, tokenizer_dir: Path | None = None,
               seed: int = 0, **overrides) -> Path:
    """Save a random ``family`` model (see :data:`FAMILIES`) into ``out`` and return ``out``.

    Every weight is drawn at 0.2 std (norm weights around their identity), so logits
    have real margins; ``tokenizer_dir``: copy its tokenizer files in (then
    ``vocab_size`` should be its vocabulary's).
    """
    import transformers

    cfg_cls, model_cls, fam = FAMILIES[family]
    cfg = getattr(transformers, cfg_cls)(**{**DIMS, "vocab_size": vocab_size, "bos_token_id": 1,
                                            "eos_token_id": 2, "pad_token_id": 0, **fam, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    offset = 0.0 if family == "gemma3" else 1.0  # Gemma's norms scale by (1 + w)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(offset + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).exists():
                shutil.copy(Path(tokenizer_dir) / name, out / name)
    return out


def hf_model(folder: Path):
    """A fresh float32 HF model of ``folder`` (fresh: HF's dynamic RoPE keeps state between calls)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
