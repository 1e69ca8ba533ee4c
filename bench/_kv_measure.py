"""Sender side of ``bench/kvtransfer.py``: the receiver process, timed transfers per
transport, and the per-stage cost of the gRPC path.

Both transports go from this process to one receiver process (``bench/_kv_receiver.py``)
over 127.0.0.1, one persistent connection each (gRPC: the sender's cached channel):

* ``grpc``: :meth:`kvtransfer.GrpcKvSender.send` of the prompt's blocks from the sender's
  paged cache into a reservation of the receiver's cache (gather, encode with CRC32,
  protobuf, HTTP/2; receiver: parse, verify, ``TransferTable.write``); timed from the call
  to the acknowledgement. The reservation is opened before the clock starts.
* ``raw_tcp``: ``sendall`` of the same number of bytes from one contiguous buffer (a
  memoryview, no copy) after an 8-byte length; the receiver ``recv_into`` a preallocated
  buffer and answers one byte; timed from the first ``sendall`` to that byte.

Repetitions alternate which transport goes first, so both see the same load.
"""

from __future__ import annotations

import json
import mmap
import socket
import statistics
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch

from decode_worker.transfers import TransferTable
from kvtransfer import KvTransferConfig, create_sender, gather_blocks
from kvtransfer.chunking import plan_chunks
from kvtransfer.wire import (
    KvChunkMeta,
    decode_chunk,
    encode_kv_chunk,
    tensor_from_bytes,
    tensor_to_bytes,
)
from pdcluster.v1 import kv_pb2, worker_pb2

HEADER = struct.Struct("<Q")
RECEIVER = Path(__file__).with_name("_kv_receiver.py")


class Receiver:
    """The receiver process and its line-based JSON control channel (a context manager)."""

    def __init__(self, shape: tuple[int, ...], max_chunk_bytes: int, threads: int = 1, grpc_workers: int = 4) -> None:
        cmd = [sys.executable, str(RECEIVER), "--shape", ",".join(map(str, shape)), "--threads", str(threads),
               "--grpc-workers", str(grpc_workers), "--max-chunk-bytes", str(max_chunk_bytes)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        info = self._read()
        self.pid = info["pid"]
        self.grpc_endpoint = f"127.0.0.1:{info['grpc_port']}"
        self.tcp_port = info["tcp_port"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"KV receiver process exited (code {self.proc.poll()})")
        return json.loads(line)

    def call(self, **msg) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def reserve(self, transfer_id: str, request_id: str, num_blocks: int,
                block_size: int) -> worker_pb2.KvDestination:
        """Open a reservation of ``num_blocks`` blocks, as a decode worker does before the
        prefill starts; returns the destination a sender is handed."""
        r = self.call(cmd="open", transfer_id=transfer_id, request_id=request_id, num_blocks=num_blocks)
        return worker_pb2.KvDestination(worker_id="bench-decode", kv_endpoint=self.grpc_endpoint,
                                        block_ids=r["block_ids"], block_size=block_size,
                                        generation=r["generation"], dtype="float32")

    def check_completed(self, transfer_id: str) -> None:
        """Raises RuntimeError unless the receiver completed ``transfer_id``."""
        done = self.call(cmd="completed", transfer_id=transfer_id)
        if not done["completed"]:
            raise RuntimeError(f"transfer {transfer_id} not completed on the receiver: {done}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def payload_view(blocks: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor as a memoryview (no copy)."""
    return memoryview(blocks.reshape(-1).view(torch.uint8).numpy())


def raw_tcp_once(sock: socket.socket, view: memoryview) -> float:
    """Seconds to push ``view`` and get the receiver's one-byte answer."""
    t0 = time.perf_counter()
    sock.sendall(HEADER.pack(len(view)))
    sock.sendall(view)
    if sock.recv(1) != b"k":
        raise RuntimeError("raw TCP receiver closed the connection")
    return time.perf_counter() - t0


class GrpcPath:
    """Transfers of one prompt's blocks with a sender of ``transport`` from the registry
    (``"grpc"``, or ``"torch_dist"``: the same control plane, tensors over a gloo pair group)
    into fresh reservations."""

    def __init__(self, receiver: Receiver, kv_cache: torch.Tensor, src_ids: list[int], layers_per_chunk: int,
                 max_chunk_bytes: int, transport: str = "grpc") -> None:
        self.receiver, self.kv_cache, self.src_ids = receiver, kv_cache, src_ids
        self.layers_per_chunk = layers_per_chunk
        self.sender = create_sender(KvTransferConfig(transport=transport, timeout_s=600.0,
                                                     max_chunk_bytes=max_chunk_bytes))
        self.count = 0
        self.last_block_ids: list[int] = []
        self.num_chunks = 0

    def once(self) -> float:
        """Seconds of one ``send`` (call to acknowledgement); raises if not completed."""
        self.count += 1
        tid = f"t{self.count}"
        dest = self.receiver.reserve(tid, f"r{self.count}", len(self.src_ids), self.kv_cache.shape[3])
        t0 = time.perf_counter()
        res = self.sender.send(f"r{self.count}", tid, dest, self.kv_cache, self.src_ids, 0,
                               layers_per_chunk=self.layers_per_chunk)
        s = time.perf_counter() - t0
        self.receiver.check_completed(tid)
        self.last_block_ids, self.num_chunks = list(dest.block_ids), res.num_chunks
        return s

    def close(self) -> None:
        self.sender.close()


def _stats(times: list[float], nbytes: int) -> dict:
    med = statistics.median(times)
    return {"latency_ms": med * 1e3, "latency_ms_min": min(times) * 1e3, "latency_ms_max": max(times) * 1e3,
            "latency_ms_all": [t * 1e3 for t in times], "gb_per_s": nbytes / med / 1e9}


def measure_transports(receiver: Receiver, kv_cache: torch.Tensor, src_ids: list[int], reps: int,
                       layers_per_chunk: int, max_chunk_bytes: int, between=None, torch_dist: bool = False) -> dict:
    """Time ``reps`` transfers of ``src_ids``'s KV per transport (after one warm-up each).

    Args:
        between: called with no argument after the warm-ups, before the timed repetitions
            (e.g. to start a profiler); None for nothing.
        torch_dist: also time the ``torch_dist`` transport, reported
            under ``"torch_dist"`` with its own ``verified`` and ``ratio_paired``.

    Returns:
        ``{"payload_bytes", "verified", "grpc": {...}, "raw_tcp": {...}, "ratio_paired"}``:
        per transport :func:`_stats` (median latency, min, max, GB/s of the median), gRPC
        also ``num_chunks``; ``verified`` = the receiver's blocks hold exactly the sent
        bytes (CRC32 of all layers); ``ratio_paired`` = median over repetitions of raw
        seconds / gRPC seconds.
    """
    blocks = gather_blocks(kv_cache, 0, kv_cache.shape[0], src_ids)
    view = payload_view(blocks)
    nbytes = len(view)
    receiver.call(cmd="raw_buffer", nbytes=nbytes)
    grpc_path = GrpcPath(receiver, kv_cache, src_ids, layers_per_chunk, max_chunk_bytes)
    sock = socket.create_connection(("127.0.0.1", receiver.tcp_port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        raw_tcp_once(sock, view)
        grpc_path.once()
        want = zlib.crc32(view)
        verified = receiver.call(cmd="digest", block_ids=grpc_path.last_block_ids)["crc32"] == want
        if between is not None:
            between()
        raw_t, grpc_t = [], []
        for i in range(reps):
            if i % 2 == 0:
                raw_t.append(raw_tcp_once(sock, view))
                grpc_t.append(grpc_path.once())
            else:
                grpc_t.append(grpc_path.once())
                raw_t.append(raw_tcp_once(sock, view))
    finally:
        sock.close()
        grpc_path.close()
    dist = _measure_dist(receiver, kv_cache, src_ids, reps, layers_per_chunk, max_chunk_bytes, view,
                         raw_t) if torch_dist else {}
    return dist | {"payload_bytes": nbytes, "verified": verified,
            "grpc": _stats(grpc_t, nbytes) | {"num_chunks": grpc_path.num_chunks, "layers_per_chunk": layers_per_chunk},
            "raw_tcp": _stats(raw_t, nbytes),
            "ratio_paired": statistics.median(r / g for r, g in zip(raw_t, grpc_t, strict=True))}


def _measure_dist(receiver: Receiver, kv_cache: torch.Tensor, src_ids: list[int], reps: int,
                  layers_per_chunk: int, max_chunk_bytes: int, view: memoryview, raw_t: list[float]) -> dict:
    path = GrpcPath(receiver, kv_cache, src_ids, layers_per_chunk, max_chunk_bytes, transport="torch_dist")
    try:
        path.once()  # warm-up: builds the pair group
        verified = receiver.call(cmd="digest", block_ids=path.last_block_ids)["crc32"] == zlib.crc32(view)
        times = [path.once() for _ in range(reps)]
    finally:
        path.close()
    return {"torch_dist": _stats(times, len(view)) | {
        "num_chunks": path.num_chunks, "layers_per_chunk": layers_per_chunk, "verified": verified,
        "ratio_paired": statistics.median(r / t for r, t in zip(raw_t, times, strict=True))}}


def _timed(acc: dict, key: str, fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    acc[key] = acc.get(key, 0.0) + time.perf_counter() - t0
    return out


def _copy_to_fresh_pages(src: memoryview) -> None:
    m = mmap.mmap(-1, len(src))  # new anonymous pages: every page faults in on first write
    m[:] = src
    m.close()


def _stage_costs_once(kv_cache: torch.Tensor, src_ids: list[int], layers_per_chunk: int, max_chunk_bytes: int,
                      table: TransferTable, receiver_threads: int) -> tuple[dict, dict, dict, int, int]:
    layers, _, _, bs, heads, dim = kv_cache.shape
    plan = plan_chunks(layers, len(src_ids), 2 * bs * heads * dim * kv_cache.element_size(), layers_per_chunk,
                       max_chunk_bytes)
    dst_ids = list(range(len(src_ids), 0, -1))
    gen = table.open("s", "r", dst_ids, time.monotonic() + 600)
    sender_threads = torch.get_num_threads()
    snd: dict[str, float] = {}
    rcv: dict[str, float] = {}
    base: dict[str, float] = {}
    total = 0
    for spec in plan:  # buffers freed as soon as the real path drops them
        blocks = _timed(snd, "gather", gather_blocks, kv_cache, spec.layer_start, spec.layer_end,
                        src_ids[spec.block_start:spec.block_end])
        payload = _timed(snd, "to_bytes", tensor_to_bytes, blocks)
        _timed(snd, "crc32", zlib.crc32, payload)
        total += len(payload)
        del payload
        meta = KvChunkMeta("r", "s", gen, spec.layer_start, spec.layer_end,
                           dst_ids[spec.block_start:spec.block_end], bs, spec.block_start * bs)
        chunk = _timed(snd, "encode_total", encode_kv_chunk, meta, blocks)
        dtype, shape = blocks.dtype, list(blocks.shape)
        del blocks
        _timed(snd, "payload_access", getattr, chunk, "payload")  # GrpcKvSender._chunks: len(chunk.payload)
        wire = _timed(snd, "serialize", chunk.SerializeToString)
        del chunk
        torch.set_num_threads(receiver_threads)
        got = _timed(rcv, "parse", kv_pb2.KvChunk.FromString, wire)
        del wire
        payload = _timed(rcv, "payload_access", getattr, got, "payload")  # decode_chunk's read of the field
        _timed(rcv, "crc32", zlib.crc32, payload)
        _timed(rcv, "from_bytes", tensor_from_bytes, payload, dtype, shape)
        del payload
        header, tensor = _timed(rcv, "decode_total", decode_chunk, got)
        _timed(rcv, "payload_len", getattr, got, "payload")  # the servicer's len(chunk.payload)
        del got
        _timed(rcv, "write", lambda *a, ts=header["token_start"]: table.write(*a, token_start=ts), "s", gen,
               header["layer_start"], header["layer_end"], header["block_ids"], tensor)
        del tensor
        torch.set_num_threads(sender_threads)
    table.close("s", gen)
    view = payload_view(gather_blocks(kv_cache, 0, layers, src_ids))
    buf = bytearray(len(view))
    buf[:] = view  # touch every page
    step = total // len(plan)
    for a in range(0, total, step):  # chunk-sized plain copies: into fresh memory, into a reused buffer
        _timed(base, "fresh_copy", _copy_to_fresh_pages, view[a:a + step])
        _timed(base, "reused_copy", buf.__setitem__, slice(a, a + step), view[a:a + step])
    snd["encode_rest"] = max(0.0, snd.pop("encode_total") - snd["to_bytes"] - snd["crc32"])
    rcv["decode_rest"] = max(0.0, rcv.pop("decode_total") - rcv["payload_access"] - rcv["crc32"] - rcv["from_bytes"])
    return snd, rcv, base, total, len(plan)


def grpc_stage_costs(kv_cache: torch.Tensor, src_ids: list[int], layers_per_chunk: int, max_chunk_bytes: int,
                     reps: int = 5, receiver_threads: int = 1) -> dict:
    """The CPU work of the gRPC path, stage by stage, run serially on this thread over the
    same chunks ``GrpcKvSender`` sends (gRPC's own transport excluded), each buffer dropped
    where the real path drops it; receiver stages at ``receiver_threads`` torch threads.
    Per stage the least of ``reps`` runs (other jobs on the machine only add time).

    Sender: ``gather`` (``gather_blocks``), ``to_bytes`` (``tensor_to_bytes``), ``crc32``,
    ``encode_rest`` (``encode_kv_chunk`` minus those two: msgpack header, building the
    ``KvChunk``), ``payload_access`` (reading ``chunk.payload``, as ``GrpcKvSender`` does for
    its byte count: protobuf's upb backend returns a new copy of a bytes field on every
    read), ``serialize`` (``SerializeToString``, what gRPC calls). Receiver: ``parse``
    (``KvChunk.FromString``), ``payload_access`` (``decode_chunk`` reading the field),
    ``crc32``, ``from_bytes`` (``tensor_from_bytes``: the copy into a writable tensor),
    ``decode_rest`` (``decode_chunk`` minus those three), ``payload_len`` (the servicer's
    ``len(chunk.payload)``: one more read), ``write`` (``TransferTable.write``:
    ``index_copy_`` into a cache).

    For reference, ``plain_copy``: the same bytes copied in chunk-sized pieces into fresh
    pages (a new anonymous ``mmap`` each: every page faults in) and into one reused, already
    touched buffer.

    Returns:
        ``{"sender": {stage: ms}, "receiver": {stage: ms}, "plain_copy": {"fresh_copy",
        "reused_copy": ms}, "payload_bytes", "num_chunks", "reps"}``.
    """
    layers, _, _, bs, heads, dim = kv_cache.shape
    dst = torch.zeros(layers, 2, len(src_ids) + 1, bs, heads, dim, dtype=kv_cache.dtype)  # pages touched
    table = TransferTable(dst)
    runs = [_stage_costs_once(kv_cache, src_ids, layers_per_chunk, max_chunk_bytes, table, receiver_threads)
            for _ in range(reps)]
    least = lambda i: {k: min(r[i][k] for r in runs) * 1e3 for k in runs[0][i]}
    return {"payload_bytes": runs[0][3], "num_chunks": runs[0][4], "reps": reps,
            "sender": least(0), "receiver": least(1), "plain_copy": least(2)}
