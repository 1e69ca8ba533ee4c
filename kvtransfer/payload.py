"""A tensor's C-order bytes as a KV chunk's payload, and back, without copies where possible.

The payload of a ``"kv"`` chunk (:mod:`kvtransfer.wire`) is the C-order bytes of a
``[layers, 2, n, block_size, num_kv_heads, head_dim]`` tensor, native byte order.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch

from kvtransfer.errors import KvIntegrityError


def tensor_payload(tensor: torch.Tensor) -> memoryview:
    """The C-order bytes of ``tensor`` (any floating dtype, bf16 included, any device) as a 1-d byte view.

    No copy for a contiguous CPU tensor (the view keeps it alive); else one copy, to CPU
    and/or to contiguous.
    """
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def nbytes_of(dtype: torch.dtype, shape: Sequence[int]) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    numel = 1
    for n in shape:
        numel *= n
    return numel * dtype.itemsize


def tensor_from_payload(payload: bytes | memoryview, dtype: torch.dtype, shape: Sequence[int], *,
                        copy: bool = True) -> torch.Tensor:
    """A CPU tensor of ``shape`` and ``dtype`` over ``payload``'s bytes (:func:`tensor_payload` inverted).

    Args:
        copy: True: a new, writable tensor that owns its memory (one copy). False: a view
            of ``payload`` (no copy; it keeps ``payload`` alive) that must only be read:
            writing into it would change the (immutable) received message.

    Raises:
        KvIntegrityError: the payload's size does not match ``shape`` and ``dtype``.
    """
    n = payload.nbytes if isinstance(payload, memoryview) else len(payload)
    want = nbytes_of(dtype, shape)
    if want != n:
        raise KvIntegrityError(f"payload is {n} bytes, shape {list(shape)} of {dtype} needs {want}")
    if want == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    if copy:
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    else:  # a ctypes view of the same address: torch.frombuffer warns on read-only buffers
        arr = np.frombuffer(payload, dtype=np.uint8)
        view = (ctypes.c_ubyte * want).from_address(arr.ctypes.data)
        view.owner = arr  # the view keeps the message alive as long as the tensor lives
        flat = torch.frombuffer(view, dtype=torch.uint8)
    return flat.view(dtype).reshape(tuple(shape))
