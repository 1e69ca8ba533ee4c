"""Read a GGUF file's Q4_1 decoder projections as they are stored (``--quantization q4``).

transformers' GGUF loader (what :mod:`engine.model_loader` uses to write the float HF folder)
dequantizes every tensor; this module reads the same file with the ``gguf`` package's
``GGUFReader`` and keeps the Q4_1 blocks of the decoder projections, split into the tensors of
:mod:`engine.kernels.cpu.quant_ops` (``qs``, ``d``, ``m``), under their HF names. Rows are put in
HF order the way transformers does it: for the ``llama`` architecture, llama.cpp's converter
permuted the rows of ``attn_q`` / ``attn_k`` (rotary halves interleaved), and the inverse
permutation (``LlamaTensorProcessor._reverse_permute_weights``) moves whole rows, hence whole
blocks. :func:`matching_blocks` then keeps only blocks that dequantize exactly to the float
weights loaded from the HF folder, so a naming or layout this module does not know falls back
to quantizing the floats instead of serving wrong weights.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from engine.kernels.cpu.quant_ops import dequantize_q4_1, q4_1_from_gguf

log = logging.getLogger(__name__)

GGUF_TO_HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj"}
"""GGUF tensor ``blk.<i>.<key>.weight`` -> HF ``model.layers.<i>.<value>.weight``."""

Q4Blocks = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _field_str(reader, key: str) -> str | None:
    field = reader.fields.get(key)
    return None if field is None else bytes(field.parts[-1]).decode()


def _field_int(reader, key: str) -> int | None:
    field = reader.fields.get(key)
    return None if field is None else int(field.parts[-1][0])


def _unpermute_rows(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """transformers' ``_reverse_permute_weights`` on dim 0 (rows) of ``t``."""
    rows = t.shape[0]
    dim = rows // n_head // 2
    return t.reshape(n_head, dim, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()


def read_q4_1_blocks(gguf_path: str | Path) -> dict[str, Q4Blocks]:
    """The Q4_1 decoder projections of ``gguf_path`` by HF weight name, rows in HF order.

    Tensors stored in another type (F32, Q8_0, K-quants, ...) are not returned.

    Returns:
        ``{"model.layers.<i>.self_attn.q_proj.weight": (qs, d, m), ...}``: ``[N, K/32, 16]`` uint8,
        ``[N, K/32]`` float32 twice (the file's fp16 ``d``/``m`` widened exactly).

    Raises:
        FileNotFoundError: no such file. ValueError: not a GGUF file (from ``gguf``).
    """
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(str(gguf_path))
    arch = _field_str(reader, "general.architecture")
    n_head = _field_int(reader, f"{arch}.attention.head_count")
    n_kv = _field_int(reader, f"{arch}.attention.head_count_kv") or n_head
    out: dict[str, Q4Blocks] = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        if t.tensor_type != GGMLQuantizationType.Q4_1 or len(parts) != 4 or parts[0] != "blk" \
                or parts[2] not in GGUF_TO_HF or parts[3] != "weight":
            continue
        blocks = q4_1_from_gguf(torch.from_numpy(np.array(t.data, dtype=np.uint8)))
        if arch == "llama" and n_head and parts[2] in ("attn_q", "attn_k"):
            heads = n_head if parts[2] == "attn_q" else n_kv
            blocks = tuple(_unpermute_rows(b, heads) for b in blocks)
        out[f"model.layers.{parts[1]}.{GGUF_TO_HF[parts[2]]}.weight"] = blocks
    return out


def matching_blocks(blocks: Mapping[str, Q4Blocks], state: Mapping[str, torch.Tensor]) -> dict[str, Q4Blocks]:
    """The entries of ``blocks`` that dequantize bit for bit to ``state``'s float weight of the same name
    (the HF folder written from the same GGUF); a mismatch is logged once and dropped."""
    kept: dict[str, Q4Blocks] = {}
    bad = []
    for name, b in blocks.items():
        w = state.get(name)
        if w is not None and w.shape == (b[0].shape[0], b[0].shape[1] * 32) \
                and torch.equal(dequantize_q4_1(*b), w.float()):
            kept[name] = b
        else:
            bad.append(name)
    if bad:
        log.warning("%d GGUF Q4_1 tensors do not match the dequantized weights (first: %s); "
                    "quantizing those from the floats", len(bad), bad[0])
    return kept
