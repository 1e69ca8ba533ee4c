"""Sender side of ``bench/kvtransfer.py``: the receiver process, timed transfers per
transport, and the per-stage cost of the gRPC path.

Both transports go from this process to one receiver process (``bench/_kv_receiver.py``)
over 127.0.0.1, one persistent connection each (gRPC: the sender's cached channel):

* ``grpc``: :meth:`kvtransfer.GrpcKvSender.send` of the prompt's blocks from the sender's
  paged cache into a reservation of the receiver's cache (gather, CRC32C, the hand-framed
  message, HTTP/2; receiver: split the message, verify, ``TransferTable.write`` from a view
  of it); timed from the call to the acknowledgement. The reservation is opened before the
  clock starts.
* ``grpc_floor``: what gRPC Python itself costs for the same messages: the gRPC path's
  frames, built once beforehand, streamed as ready ``bytes`` on the same kind of call to a
  handler in the receiver process that drops them (``/bench.KvFloor/Push``, no KV work on
  either side); timed like ``grpc``.
* ``raw_tcp``: ``sendall`` of the same number of bytes from one contiguous buffer (a
  memoryview, no copy) after an 8-byte length; the receiver ``recv_into`` a preallocated
  buffer and answers one byte; timed from the first ``sendall`` to that byte.

Repetitions alternate which transport goes first, so both see the same load.
"""

from __future__ import annotations

import json
import socket
import statistics
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import grpc
import torch
from _kv_receiver import FLOOR_SERVICE

from kvtransfer import KvTransferConfig, create_sender, gather_blocks
from kvtransfer.chunking import plan_chunks
from kvtransfer.frames import frame_bytes
from kvtransfer.grpc_sender import CHANNEL_OPTIONS
from kvtransfer.wire import KvChunkMeta, encode_kv_chunk
from pdcluster.v1 import worker_pb2

HEADER = struct.Struct("<Q")
RECEIVER = Path(__file__).with_name("_kv_receiver.py")


class Receiver:
    """The receiver process and its line-based JSON control channel (a context manager)."""

    def __init__(self, shape: tuple[int, ...], max_chunk_bytes: int, threads: int = 1, grpc_workers: int = 4,
                 device: str = "cpu", dtype: str = "float32") -> None:
        cmd = [sys.executable, str(RECEIVER), "--shape", ",".join(map(str, shape)), "--threads", str(threads),
               "--grpc-workers", str(grpc_workers), "--max-chunk-bytes", str(max_chunk_bytes),
               "--device", device, "--dtype", dtype]
        self.dtype = dtype
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
                                        generation=r["generation"], dtype=self.dtype)

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
    """The bytes of a contiguous tensor as a memoryview (no copy on CPU; a host copy of a device tensor)."""
    return memoryview(blocks.reshape(-1).view(torch.uint8).cpu().numpy())


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


FLOOR_METHOD = f"/{FLOOR_SERVICE}/Push"


def chunk_plan(kv_cache: torch.Tensor, src_ids: list[int], layers_per_chunk: int, max_chunk_bytes: int,
               generation: int = 1) -> list[tuple[KvChunkMeta, list[int]]]:
    """The chunks ``GrpcKvSender`` sends for ``src_ids`` (same plan), each as (its meta into a
    reservation of descending block ids ``len(src_ids) .. 1``, its source block ids)."""
    layers, _, _, bs, heads, dim = kv_cache.shape
    plan = plan_chunks(layers, len(src_ids), 2 * bs * heads * dim * kv_cache.element_size(), layers_per_chunk,
                       max_chunk_bytes)
    dst_ids = list(range(len(src_ids), 0, -1))
    return [(KvChunkMeta("r", "s", generation, c.layer_start, c.layer_end, dst_ids[c.block_start:c.block_end], bs,
                         c.block_start * bs), src_ids[c.block_start:c.block_end]) for c in plan]


class GrpcFloor:
    """gRPC Python's own cost for the gRPC path's messages: its frames, built once, streamed as
    ready ``bytes`` (identity serializer, the sender's channel options) to a handler in the
    receiver process that drops them."""

    def __init__(self, receiver: Receiver, kv_cache: torch.Tensor, src_ids: list[int], layers_per_chunk: int,
                 max_chunk_bytes: int) -> None:
        self.messages = [frame_bytes(encode_kv_chunk(m, gather_blocks(kv_cache, m.layer_start, m.layer_end, ids)))
                         for m, ids in chunk_plan(kv_cache, src_ids, layers_per_chunk, max_chunk_bytes)]
        self.channel = grpc.insecure_channel(receiver.grpc_endpoint, options=list(CHANNEL_OPTIONS))
        self.push = self.channel.stream_unary(FLOOR_METHOD)

    def once(self) -> float:
        t0 = time.perf_counter()
        got = self.push(iter(self.messages), timeout=600)
        s = time.perf_counter() - t0
        if int(got) != sum(len(m) for m in self.messages):
            raise RuntimeError(f"floor receiver counted {got!r} bytes")
        return s

    def close(self) -> None:
        self.channel.close()


def _alternating(reps: int, runs: dict) -> dict[str, list[float]]:
    """``reps`` timings per named run, the order rotating every repetition."""
    names = list(runs)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(reps):
        for n in names[i % len(names):] + names[:i % len(names)]:
            times[n].append(runs[n]())
    return times


def measure_transports(receiver: Receiver, kv_cache: torch.Tensor, src_ids: list[int], reps: int,
                       layers_per_chunk: int, max_chunk_bytes: int, between=None, torch_dist: bool = False) -> dict:
    """Time ``reps`` transfers of ``src_ids``'s KV per transport (after one warm-up each).

    ``raw_tcp``, ``grpc`` and ``grpc_floor`` alternate (the order rotating per repetition);
    ``torch_dist`` runs after them.

    Args:
        between: called with no argument after the warm-ups, before the timed repetitions
            (e.g. to start a profiler); None for nothing.
        torch_dist: also time the ``torch_dist`` transport, reported
            under ``"torch_dist"`` with its own ``verified`` and ``ratio_paired``.

    Returns:
        ``{"payload_bytes", "verified", "grpc", "grpc_floor", "raw_tcp", "ratio_paired"}``:
        per transport :func:`_stats` (median latency, min, max, GB/s of the median), gRPC
        also ``num_chunks``, the floor its own ``ratio_paired``; ``verified`` = the
        receiver's blocks hold exactly the sent bytes (CRC32 of all layers);
        ``ratio_paired`` = median over repetitions of raw seconds / gRPC seconds.
    """
    view = payload_view(gather_blocks(kv_cache, 0, kv_cache.shape[0], src_ids))
    nbytes = len(view)
    receiver.call(cmd="raw_buffer", nbytes=nbytes)
    grpc_path = GrpcPath(receiver, kv_cache, src_ids, layers_per_chunk, max_chunk_bytes)
    floor = GrpcFloor(receiver, kv_cache, src_ids, layers_per_chunk, max_chunk_bytes)
    sock = socket.create_connection(("127.0.0.1", receiver.tcp_port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        raw_tcp_once(sock, view)
        floor.once()
        grpc_path.once()
        verified = receiver.call(cmd="digest", block_ids=grpc_path.last_block_ids)["crc32"] == zlib.crc32(view)
        if between is not None:
            between()
        t = _alternating(reps, {"raw_tcp": lambda: raw_tcp_once(sock, view), "grpc": grpc_path.once,
                                "grpc_floor": floor.once})
    finally:
        sock.close()
        grpc_path.close()
        floor.close()
    raw_t = t["raw_tcp"]
    dist = _measure_dist(receiver, kv_cache, src_ids, reps, layers_per_chunk, max_chunk_bytes, view,
                         raw_t) if torch_dist else {}
    paired = lambda name: statistics.median(r / g for r, g in zip(raw_t, t[name], strict=True))  # noqa: E731
    return dist | {"payload_bytes": nbytes, "verified": verified,
                   "grpc": _stats(t["grpc"], nbytes) | {"num_chunks": grpc_path.num_chunks,
                                                        "layers_per_chunk": layers_per_chunk},
                   "grpc_floor": _stats(t["grpc_floor"], nbytes) | {"num_chunks": len(floor.messages),
                                                                    "ratio_paired": paired("grpc_floor")},
                   "raw_tcp": _stats(raw_t, nbytes), "ratio_paired": paired("grpc")}


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
