"""Model construction and weight loading."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from common.model_config import ModelConfig
from engine.attention import get_attention_backend
from engine.config import check_quantization
from engine.gguf_blocks import matching_blocks, read_q4_1_blocks
from engine.model.arch import DecoderArch
from engine.model.decoder import CausalLM
from engine.model.families import load_arch
from engine.model.fuse import merge_projections
from engine.model.linear import apply_linear_backend, default_linear_backend
from engine.model.quant import apply_quantization

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """``auto`` device = cuda when available else cpu; ``auto`` dtype = float32 on CPU
    (bf16 matmul on AVX2 CPUs is ~200x slower), bfloat16 on CUDA."""
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    if dtype == "auto":
        return dev, (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    return dev, _DTYPES[dtype]


def default_attention_backend(device: torch.device) -> str:
    """``"triton"`` (the paged Triton kernels) on CUDA, ``"torch"`` (the C++ paged decode kernel for decode
    rows where it is built, vectorized SDPA for the rest) elsewhere."""
    return "triton" if torch.device(device).type == "cuda" else "torch"


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


def load_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
               attention_backend: str | None = None, linear_backend: str | None = None,
               arch: DecoderArch | None = None, quantization: str = "none",
               gguf_path: str | Path | None = None) -> CausalLM:
    """Build the model on ``device`` in ``dtype`` and load every ``*.safetensors`` in ``cfg.path``.

    ``arch``: the family's layer differences; None reads them from ``cfg.path``
    (:func:`engine.model.families.load_arch`).

    ``attention_backend`` names a registered backend; None picks
    :func:`default_attention_backend` for ``device``. ``linear_backend`` names one of
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
    backend = get_attention_backend(attention_backend or default_attention_backend(device))
    with torch.device(device):
        model = CausalLM(cfg, arch, backend).to(dtype).requires_grad_(False)
    model.load_weights(state)
    model.eval()
    blocks = None
    if quantization == "q4" and gguf_path is not None:
        blocks = matching_blocks(read_q4_1_blocks(gguf_path), state)
    del state
    apply_quantization(model, quantization, blocks)
    merge_projections(model)
    apply_linear_backend(model, linear_backend or default_linear_backend(device, dtype))
    return model
