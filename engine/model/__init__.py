"""Model construction and weight loading."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from safetensors.torch import load_file
from torch import nn
from torch.overrides import TorchFunctionMode

from common.model_arch import DecoderArch
from common.model_config import ModelConfig
from engine.attention import get_attention_backend
from engine.config import check_quantization
from engine.gguf_blocks import matching_blocks, read_q4_1_blocks
from engine.model.decoder import CausalLM
from engine.model.families import load_arch
from engine.model.fuse import merge_projections
from engine.model.linear import apply_linear_backend, default_linear_backend
from engine.model.quant import apply_quantization

M = TypeVar("M", bound=nn.Module)
_RANDOM_INITS = frozenset({nn.init.uniform_, nn.init.normal_, nn.init.trunc_normal_, nn.init.kaiming_uniform_,
                           torch.Tensor.uniform_, torch.Tensor.normal_})
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """``auto`` device = cuda when available else cpu; ``auto`` dtype = float32 on CPU
    (bf16 matmul on AVX2 CPUs is ~200x slower), bfloat16 on CUDA."""
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    if dtype == "auto":
        return dev, (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    return dev, _DTYPES[dtype]


def default_attention_backend(device: torch.device, quantization: str = "none",
                              dtype: torch.dtype = torch.float32) -> str:
    """``"triton"`` (the paged Triton kernels) on CUDA; elsewhere ``"torch"`` (the C++ paged decode kernel for
    decode rows where it is built, vectorized SDPA for the rest), and for quantized weights
    (``quantization`` int8 / q4) in float32 ``"batch-invariant"`` (every row through that kernel): their
    per-call activation quantization turns SDPA's shape-dependent rounding into different tokens after a
    prefix-cache hit, a chunked prefill or a recompute (:mod:`engine.attention.torch_backend`). That
    kernel is float32-only, so another ``dtype`` keeps ``"torch"``."""
    if torch.device(device).type == "cuda":
        return "triton"
    return "batch-invariant" if quantization != "none" and dtype == torch.float32 else "torch"


def read_state(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` in ``folder``, by name (CPU).

    Raises:
        FileNotFoundError: no safetensors file in the folder.
    """
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


class _SkipRandomInit(TorchFunctionMode):
    """Leaves the tensors a module's constructor would fill with random values as allocated."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RANDOM_INITS:  # torch.nn.init's functions pass the tensor by keyword, its methods first
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        return func(*args, **kwargs)


def build_unloaded(make: Callable[[], M], device: torch.device, dtype: torch.dtype) -> M:
    """``make()`` (a model's constructor) on ``device`` in ``dtype``, its parameters allocated but
    not randomly initialised, for a loader that then writes every one of them.

    The random initialisation a checkpoint overwrites is skipped (the calls of ``torch.nn.init``
    and ``Tensor.uniform_`` / ``normal_`` while ``make`` runs return their tensor as it is), as
    ``transformers`` skips it when loading a checkpoint: ~1 s of a worker's start for SmolLM2 at
    one thread. Building on the ``meta`` device instead would cost more here: its ``normal_``
    imports ``torch._dynamo`` (~3 s).
    """
    with torch.device(device), _SkipRandomInit():
        model = make()
    return model.to(dtype).requires_grad_(False)


def load_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
               attention_backend: str | None = None, linear_backend: str | None = None,
               arch: DecoderArch | None = None, quantization: str = "none",
               gguf_path: str | Path | None = None) -> CausalLM:
    """Build the model on ``device`` in ``dtype`` and load every ``*.safetensors`` in ``cfg.path``.

    ``arch``: the family's layer differences; None reads them from ``cfg.path``
    (:func:`engine.model.families.load_arch`).

    ``attention_backend`` names a registered backend; None picks
    :func:`default_attention_backend` for ``device``, ``quantization`` and ``dtype``. ``linear_backend`` names one of
    :data:`engine.model.linear.LINEAR_BACKENDS` (``"torch"``, ``"panel"``, ``"onednn"``, ...); None picks
    :func:`~engine.model.linear.default_linear_backend` (panel-packed weights for CPU
    float32). A packed model's decoder weights are buffers, no longer parameters.

    ``quantization`` (one of :data:`engine.config.QUANTIZATIONS`): ``"none"`` keeps the float
    weights; ``"int8"`` / ``"q4"`` replace the decoder projections (q/k/v/o, gate/up/down) with
    quantized layers (:mod:`engine.model.quant`; both quantize the LM head to int8; the embedding stays
    float). With ``"q4"`` and ``gguf_path`` (the GGUF ``cfg.path`` was dequantized from), the file's own Q4_1 blocks are
    served where they dequantize exactly to the loaded weights (:mod:`engine.gguf_blocks`).
    Then each layer's q/k/v and gate/up projections are merged into one matmul each
    (:func:`engine.model.fuse.merge_projections`), before the linear backend packs them.

    Raises:
        FileNotFoundError: no safetensors file in the folder.
        KeyError: a parameter missing from the checkpoint, or an unknown backend.
        common.model_config.ConfigError: an unsupported architecture or feature, or an unknown
            ``quantization``.
    """
    check_quantization(quantization)
    arch = arch or load_arch(cfg.path)
    state = read_state(cfg.path)
    backend = get_attention_backend(attention_backend or default_attention_backend(device, quantization, dtype))
    model = build_unloaded(lambda: CausalLM(cfg, arch, backend), device, dtype)
    model.load_weights(state)  # writes every parameter (raises KeyError for one the checkpoint lacks)
    model.eval()
    blocks = None
    if quantization == "q4" and gguf_path is not None:
        blocks = matching_blocks(read_q4_1_blocks(gguf_path), state)
    del state
    apply_quantization(model, quantization, blocks)
    merge_projections(model)
    apply_linear_backend(model, linear_backend or default_linear_backend(device, dtype))
    return model
