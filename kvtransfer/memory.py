"""Keep freed message buffers mapped: glibc ``malloc`` settings for a process that moves KV over gRPC.

Every ``PushKv`` message is a few MiB that gRPC Python copies into buffers of its own on
both sides (the sender's ``bytes`` into a slice, the receiver's slices into one ``bytes``),
and the sender frames each chunk into a new ``bytes``. With glibc's defaults these buffers
come from fresh pages every time: a freed block of a few MiB is returned to the kernel (the
heap top is trimmed, or a block above the adaptive mmap threshold is unmapped) and the next
one faults its pages in again, which on this 2-core machine costs more than all the copies
(``bench/results/kvtransfer.md``: a copy into fresh pages runs at about a tenth of a copy into
mapped ones). :func:`keep_freed_memory` sets a fixed mmap threshold (blocks below it come from
the heap) and a high trim threshold (freed heap memory stays mapped, up to that much), as
allocators with caches (jemalloc, tcmalloc, PyTorch's CUDA caching allocator) do.

The gRPC KV sender and receiver call it when they are created (:class:`GrpcKvSender`,
:func:`~kvtransfer.grpc_receiver.add_kv_transfer_servicer`), so every worker that moves KV
keeps up to :data:`TRIM_THRESHOLD_BYTES` of freed heap mapped per malloc arena. Elsewhere
than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import threading

log = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
"""Blocks of at least this size are mapped on their own (and unmapped when freed): glibc's
largest allowed threshold; KV messages (``max_chunk_bytes``, 4 MiB by default) stay below it."""

TRIM_THRESHOLD_BYTES = 64 * 1024 * 1024
"""Free memory at the top of a heap kept mapped before glibc returns it to the kernel: room for the
messages a few concurrent transfers have in flight (each a few MiB: a sender frames one ahead, gRPC holds
one per direction and stream, a receiver reads one ahead)."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_lock = threading.Lock()
_done: bool | None = None


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds once per process (see the module docstring).

    Returns:
        True when the thresholds are set (now or before); False where ``mallopt`` is not
        glibc's or refused them (nothing changed).
    """
    global _done
    with _lock:
        if _done is None:
            _done = _mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and _mallopt(_M_TRIM_THRESHOLD,
                                                                                  TRIM_THRESHOLD_BYTES)
            if _done:
                log.info("malloc keeps freed KV message buffers mapped: mmap threshold %d MiB, trim threshold "
                         "%d MiB", MMAP_THRESHOLD_BYTES >> 20, TRIM_THRESHOLD_BYTES >> 20)
        return _done


def _mallopt(param: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: its parameter numbers are glibc's
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(param, value) == 1
