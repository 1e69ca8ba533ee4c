"""Build a worker's model runner: resolve the model, load the weights, allocate the KV cache."""

from __future__ import annotations

import torch

from common.model_arch import DecoderArch
from common.model_config import ConfigError, ModelConfig
from engine.config import CacheConfig, check_attention_backend, check_quantization
from engine.kernels.cpu.build import load_all as load_cpu_kernels
from engine.kv_cache import allocate_kv_cache
from engine.model import load_model, resolve_device_dtype
from engine.model_loader import resolve_model_source
from engine.model_runner import ModelRunner
from engine.tp.runner import start_tp_runner


def build_runner(model: str, cache: CacheConfig, *, device: str = "auto", dtype: str = "auto",
                 num_threads: int = 1, model_cache_dir: str | None = None,
                 tp: int = 1, quantization: str = "none", attention_backend: str = "auto",
                 arch: DecoderArch | None = None) -> tuple[ModelConfig, ModelRunner]:
    """Load (building where needed) the C++ CPU kernels, resolve ``model``, load its weights,
    allocate the KV cache (``cache``), set the torch thread budget.

    Args:
        model: a model spec accepted by :func:`engine.model_loader.resolve_model`.
        cache: KV cache geometry (blocks, block size in tokens, dtype).
        device / dtype: ``"auto"`` = CUDA + bfloat16 where available, else CPU + float32.
        num_threads: torch intra-op threads (this worker's CPU share).
        model_cache_dir: where converted models are kept (default ``$PDCLUSTER_MODEL_CACHE``, else
            ``~/.cache/pdcluster/models``: :func:`engine.model_loader.default_cache_dir`).
        tp: tensor-parallel ranks; above 1 this process is rank 0 and starts the others
            (:func:`engine.tp.runner.start_tp_runner`), and ``runner.close()`` stops them.
        quantization: one of :data:`engine.config.QUANTIZATIONS` (decoder projections served as
            int8 or Q4_1, :func:`engine.model.load_model`); only with ``tp == 1``.
        attention_backend: one of :data:`engine.config.ATTENTION_BACKENDS`; ``"auto"``:
            :func:`engine.model.default_attention_backend` for the device, quantization and dtype; another
            only with ``tp == 1`` (the tensor-parallel model picks its own).
        arch: the model family's layer differences, when the caller has read them already
            (``pdcluster up`` has: a worker then does not import ``transformers`` to read them
            again, ~3 s of its start); None reads them from the model's folder
            (:func:`engine.model.families.load_arch`).

    Raises:
        ModelNotFoundError: the model spec names nothing loadable.
        ConfigError: the model does not split over ``tp`` ranks; an unknown ``quantization`` or
            ``attention_backend``, either set with ``tp > 1``, or a backend that does not run on the
            resolved device.
    """
    check_quantization(quantization)
    check_attention_backend(attention_backend, dtype=dtype)
    if quantization != "none" and tp > 1:
        raise ConfigError(f"quantization {quantization!r} is not supported with tp={tp} (tensor-parallel "
                          f"layers are float only); use quantization='none' or tp=1")
    if attention_backend != "auto" and tp > 1:
        raise ConfigError(f"attention_backend {attention_backend!r} is not supported with tp={tp} (the "
                          f"tensor-parallel model picks its own); use 'auto' or tp=1")
    torch.set_num_threads(num_threads)
    load_cpu_kernels()  # compiled now if this checkout has not built them: not on the first request
    folder, gguf = resolve_model_source(model, model_cache_dir)
    model_cfg = ModelConfig.from_hf_folder(folder, name=model)
    dev, dt = resolve_device_dtype(device, dtype)
    check_attention_backend(attention_backend, dev.type)
    if tp > 1:
        return model_cfg, start_tp_runner(model_cfg, cache, tp, dev, dt, num_threads, arch=arch)
    net = load_model(model_cfg, dev, dt, arch=arch, quantization=quantization, gguf_path=gguf,
                     attention_backend=None if attention_backend == "auto" else attention_backend)
    kv_cache = allocate_kv_cache(model_cfg, cache, dev)
    return model_cfg, ModelRunner(net, kv_cache, cache.block_size)
