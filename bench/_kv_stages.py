"""The gRPC KV path's own CPU work, stage by stage, for ``bench/kvtransfer.py``: the same
chunks ``GrpcKvSender`` sends, each stage run serially on this thread and timed on its own.

Sender: ``onepass`` (``kvtransfer.onepass.frame_kv_chunk``: the blocks gathered straight into
the message and checksummed on the way, the sender's real path where the C++ kernel is built);
without the kernel, the plain path: ``gather`` (``gather_blocks`` into one reused buffer),
``crc32c`` (of the gathered blocks, in place), ``header`` (``encode_kv_chunk`` minus its CRC32C:
the msgpack header and the frame around a view of the blocks), ``frame`` (``frame_bytes``:
gRPC's request serializer, the copy of the payload into the message). Receiver: ``parse`` (``parse_frame``: gRPC's request
deserializer, a view into the message), ``crc32c`` (in place), ``decode_rest``
(``decode_chunk`` minus its CRC32C: header checks, the read-only tensor view), ``write``
(``TransferTable.write``: ``index_copy_`` from the view into the reserved blocks).

For reference, ``plain_copy``: the same bytes copied in chunk-sized pieces into fresh pages
(a new anonymous ``mmap`` each: every page faults in) and into one reused, already touched
buffer. gRPC's own work (its copies, HTTP/2, the socket) is what ``grpc_floor`` in
``bench/_kv_measure.py`` measures.
"""

from __future__ import annotations

import mmap
import time

import torch
from _kv_measure import chunk_plan, payload_view

from decode_worker.transfers import TransferTable
from kvtransfer import gather_blocks, onepass
from kvtransfer.checksum import crc32c
from kvtransfer.frames import frame_bytes, parse_frame
from kvtransfer.wire import decode_chunk, encode_kv_chunk


def _timed(acc: dict, key: str, fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    acc[key] = acc.get(key, 0.0) + time.perf_counter() - t0
    return out


def _copy_to_fresh_pages(src: memoryview) -> None:
    m = mmap.mmap(-1, len(src))  # new anonymous pages: every page faults in on first write
    m[:] = src
    m.close()


def _once(kv_cache: torch.Tensor, src_ids: list[int], layers_per_chunk: int, max_chunk_bytes: int,
          table: TransferTable, receiver_threads: int) -> tuple[dict, dict, dict, int, int]:
    gen = table.open("s", "r", list(range(len(src_ids), 0, -1)), time.monotonic() + 600)
    plan = chunk_plan(kv_cache, src_ids, layers_per_chunk, max_chunk_bytes, gen)
    sender_threads = torch.get_num_threads()
    snd: dict[str, float] = {}
    rcv: dict[str, float] = {}
    base: dict[str, float] = {}
    total = 0
    per_block = 2 * kv_cache[0, 0, 0].numel()
    buffer = torch.empty(max((m.layer_end - m.layer_start) * len(ids) * per_block for m, ids in plan),
                         dtype=kv_cache.dtype)
    fused = onepass.available()
    for meta, ids in plan:  # buffers freed as soon as the real path drops them
        if fused:
            wire = _timed(snd, "onepass", onepass.frame_kv_chunk, meta, kv_cache, ids)
            total += (meta.layer_end - meta.layer_start) * len(ids) * per_block * kv_cache.element_size()
        else:
            blocks = _timed(snd, "gather", gather_blocks, kv_cache, meta.layer_start, meta.layer_end, ids, buffer)
            _timed(snd, "crc32c", crc32c, blocks)
            frame = _timed(snd, "encode_total", encode_kv_chunk, meta, blocks)
            wire = _timed(snd, "frame", frame_bytes, frame)
            total += blocks.numel() * blocks.element_size()
            del frame, blocks
        torch.set_num_threads(receiver_threads)
        got = _timed(rcv, "parse", parse_frame, wire)
        _timed(rcv, "crc32c", crc32c, got.payload)
        header, tensor = _timed(rcv, "decode_total", lambda f: decode_chunk(f, copy=False), got)
        _timed(rcv, "write", lambda *a, ts=header["token_start"]: table.write(*a, token_start=ts), "s", gen,
               header["layer_start"], header["layer_end"], header["block_ids"], tensor)
        del tensor, got, wire
        torch.set_num_threads(sender_threads)
    table.close("s", gen)
    view = payload_view(gather_blocks(kv_cache, 0, kv_cache.shape[0], src_ids))
    buf = bytearray(len(view))
    buf[:] = view  # touch every page
    step = total // len(plan)
    for a in range(0, total, step):  # chunk-sized plain copies: into fresh memory, into a reused buffer
        _timed(base, "fresh_copy", _copy_to_fresh_pages, view[a:a + step])
        _timed(base, "reused_copy", buf.__setitem__, slice(a, a + step), view[a:a + step])
    if "encode_total" in snd:
        snd["header"] = max(0.0, snd.pop("encode_total") - snd["crc32c"])
    rcv["decode_rest"] = max(0.0, rcv.pop("decode_total") - rcv["crc32c"])
    return snd, rcv, base, total, len(plan)


def grpc_stage_costs(kv_cache: torch.Tensor, src_ids: list[int], layers_per_chunk: int, max_chunk_bytes: int,
                     reps: int = 5, receiver_threads: int = 1) -> dict:
    """The CPU work of the gRPC path, stage by stage (see the module docstring), run serially
    on this thread over the same chunks ``GrpcKvSender`` sends, each buffer dropped where the
    real path drops it; receiver stages at ``receiver_threads`` torch threads. Per stage the
    least of ``reps`` runs (other jobs on the machine only add time).

    Returns:
        ``{"sender": {stage: ms}, "receiver": {stage: ms}, "plain_copy": {"fresh_copy",
        "reused_copy": ms}, "payload_bytes", "num_chunks", "reps"}``.
    """
    layers, _, _, bs, heads, dim = kv_cache.shape
    dst = torch.zeros(layers, 2, len(src_ids) + 1, bs, heads, dim, dtype=kv_cache.dtype)  # pages touched
    table = TransferTable(dst)
    runs = [_once(kv_cache, src_ids, layers_per_chunk, max_chunk_bytes, table, receiver_threads) for _ in range(reps)]
    least = lambda i: {k: min(r[i][k] for r in runs) * 1e3 for k in runs[0][i]}  # noqa: E731
    return {"payload_bytes": runs[0][3], "num_chunks": runs[0][4], "reps": reps,
            "sender": least(0), "receiver": least(1), "plain_copy": least(2)}
