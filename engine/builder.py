"""Build a worker's model runner from its :class:`WorkerConfig`."""

from __future__ import annotations

import torch

from engine.config import ModelConfig, WorkerConfig
from engine.kv_cache import allocate_kv_cache
from engine.model import load_model, resolve_device_dtype
from engine.model_loader import resolve_model
from engine.model_runner import ModelRunner


def build_runner(cfg: WorkerConfig) -> tuple[ModelConfig, ModelRunner]:
    """Resolve the model, load weights, allocate the KV cache (``cfg.cache``), set the
    torch thread budget (``cfg.num_threads``).

    Raises:
        ModelNotFoundError: the model spec names nothing loadable.
    """
    torch.set_num_threads(cfg.num_threads)
    folder = resolve_model(cfg.model, cfg.model_cache_dir)
    model_cfg = ModelConfig.from_hf_folder(folder, name=cfg.model)
    device, dtype = resolve_device_dtype(cfg.device, cfg.dtype)
    model = load_model(model_cfg, device, dtype)
    kv_cache = allocate_kv_cache(model_cfg, cfg.cache, device)
    return model_cfg, ModelRunner(model, kv_cache, cfg.cache.block_size)
