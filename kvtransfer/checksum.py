"""CRC32C (Castagnoli) of KV payloads with the hardware instruction, without copying the bytes.

The ``checksum`` of every KV chunk (:mod:`kvtransfer.wire`) is the CRC32C of its tensor's
C-order bytes, computed by ``google-crc32c``'s C library (SSE4.2 / ARMv8 CRC instructions,
a table fallback elsewhere; about 3x zlib's CRC32 here). Its Python binding takes only
``bytes``, so :func:`crc32c` calls the library's ``crc32c_extend`` through :mod:`ctypes` on
the buffer's address instead: a contiguous tensor, a memoryview into a received message or
a gathered chunk is read in place, with the GIL released. Where the binding's library cannot
be reached that way (a pure-Python install of ``google-crc32c``), it falls back to
``google_crc32c.value`` over a copy.
"""

from __future__ import annotations

import ctypes
from typing import Any

import google_crc32c
import numpy as np
import torch


def _native_extend() -> Any:
    """``crc32c_extend(crc, data, n)`` of the library behind ``google_crc32c``'s C extension, or ``None``."""
    if google_crc32c.implementation != "c":
        return None
    try:
        from google_crc32c import _crc32c  # its C extension links the library: dlsym finds it through it

        fn = ctypes.CDLL(_crc32c.__file__).crc32c_extend
    except (ImportError, OSError, AttributeError):
        return None
    fn.restype = ctypes.c_uint32
    fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    return fn


_EXTEND = _native_extend()


def crc32c_extend_address() -> int | None:
    """The address of the C function ``uint32_t crc32c_extend(uint32_t crc, const uint8_t *data, size_t n)``
    that :func:`crc32c` calls (for C++ code checksumming as it copies), or ``None`` without it."""
    return None if _EXTEND is None else ctypes.cast(_EXTEND, ctypes.c_void_p).value


def _address(buf: Any) -> tuple[int, int]:
    """``(address, nbytes)`` of a C-contiguous buffer (bytes, bytearray, memoryview, numpy array)."""
    arr = np.frombuffer(buf, dtype=np.uint8)  # a view; read-only buffers are fine
    return arr.ctypes.data, arr.nbytes


def crc32c(data: Any) -> int:
    """CRC32C of ``data``'s bytes, read in place.

    Args:
        data: ``bytes``, ``bytearray``, a C-contiguous ``memoryview`` / numpy array, or a
            tensor (its C-order bytes; a non-contiguous one or one off the CPU is copied
            to a contiguous CPU tensor first).

    Returns:
        The checksum, an int in ``[0, 2**32)``; 0 for no bytes.

    Raises:
        ValueError / BufferError: ``data`` is a buffer that is not C-contiguous.
    """
    if isinstance(data, torch.Tensor):
        t = data.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        if _EXTEND is not None:
            return int(_EXTEND(0, t.data_ptr(), t.numel() * t.element_size()))
        data = t.reshape(-1).view(torch.uint8).numpy()
    if _EXTEND is None:
        return int(google_crc32c.value(data if isinstance(data, bytes) else bytes(data)))
    address, nbytes = _address(data)
    return int(_EXTEND(0, address, nbytes)) if nbytes else 0
