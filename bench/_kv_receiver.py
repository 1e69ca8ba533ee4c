"""Decode side of ``bench/kvtransfer.py``, run as its own process (as a decode worker is).

It holds a real paged KV cache ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``
(zeros; float32 on CPU unless ``--dtype`` / ``--device`` say otherwise) and serves, on 127.0.0.1 (ephemeral ports):

* gRPC: ``KvTransfer.PushKv`` through the ``torch_dist`` transport's receiver
  (:func:`kvtransfer.attach_receiver`; it takes ``grpc`` senders too) with
  :class:`TableSink`, a :class:`kvtransfer.KvReceiverSink` over
  :class:`decode_worker.transfers.TransferTable` (reservation check + ``index_copy_`` into
  the cache under the table's lock, as the decode worker's sink does, without a scheduler);
* ``/bench.KvFloor/Push`` on the same gRPC server: a stream of ready messages whose bytes it
  counts and drops, answering the count as decimal ASCII (``grpc_floor``: gRPC Python's own
  cost for the gRPC path's messages, no KV work);
* raw TCP: a thread accepting connections; per message an 8-byte little-endian length,
  then that many bytes ``recv_into`` one preallocated buffer, answered by one byte.

Control: one JSON object per line on stdin, one JSON reply per line on stdout (the first
line is ``{"grpc_port", "tcp_port", "pid"}``):

* ``{"cmd": "open", "transfer_id", "request_id", "num_blocks"}`` -> ``{"generation",
  "block_ids"}``: a reservation, as the decode worker makes before the prefill starts
  (block ids in descending order: a reservation's blocks need not be contiguous);
* ``{"cmd": "completed", "transfer_id"}`` -> ``{"completed": bool}``;
* ``{"cmd": "digest", "block_ids"}`` -> ``{"crc32"}`` of those blocks' bytes, all layers;
* ``{"cmd": "raw_buffer", "nbytes"}`` -> ``{"ok"}``: (re)allocate the raw TCP buffer;
* ``{"cmd": "quit"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages

import grpc
import torch

from decode_worker.transfers import TransferTable
from kvtransfer import (
    KvReceiverSink,
    KvTransferConfig,
    StaleTransferError,
    attach_receiver,
    gather_blocks,
    kv_server_options,
)

HEADER = struct.Struct("<Q")
FLOOR_SERVICE = "bench.KvFloor"


class TableSink(KvReceiverSink):
    """:class:`KvReceiverSink` over a :class:`TransferTable`; ``complete`` closes the
    reservation (the blocks then belong to the running request) and records it."""

    def __init__(self, table: TransferTable) -> None:
        self.table = table
        self.completed: set[str] = set()
        self.failed: dict[str, str] = {}

    def begin(self, transfer_id, generation, request_id) -> bool:
        return self.table.is_open(transfer_id, generation)

    def write(self, transfer_id, generation, layer_start, layer_end, block_ids, tensor, *, token_start) -> None:
        self.table.write(transfer_id, generation, layer_start, layer_end, list(block_ids), tensor,
                         token_start=token_start)

    def complete(self, transfer_id, generation, first_token_id, first_token_logprobs) -> None:
        if self.table.close(transfer_id, generation) is None:
            raise StaleTransferError(f"transfer {transfer_id} generation {generation} is not open")
        self.completed.add(transfer_id)

    def fail(self, transfer_id, generation, reason) -> None:
        if self.table.close(transfer_id, generation) is not None:
            self.failed[transfer_id] = reason


def _drop_messages(requests, context) -> bytes:
    """``/bench.KvFloor/Push``: count and drop the messages' bytes."""
    return str(sum(len(m) for m in requests)).encode()


def _recv_exact(conn: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


class RawTcpServer:
    """Receives length-prefixed messages into one preallocated buffer, acks each with one byte."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = bytearray(nbytes)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="raw-tcp").start()

    def _accept(self) -> None:
        while True:
            conn, _ = self.sock.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        head = bytearray(HEADER.size)
        with conn:
            while _recv_exact(conn, memoryview(head)):
                (n,) = HEADER.unpack(head)
                if n > len(self.buffer):
                    return
                if not _recv_exact(conn, memoryview(self.buffer)[:n]):
                    return
                conn.sendall(b"k")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", required=True, help="KV cache shape: layers,2,blocks,block_size,kv_heads,head_dim")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (cache writes)")
    p.add_argument("--grpc-workers", type=int, default=4, help="gRPC server thread pool")
    p.add_argument("--max-chunk-bytes", type=int, required=True, help="the senders' max_chunk_bytes")
    p.add_argument("--raw-bytes", type=int, default=1 << 20, help="initial raw TCP buffer size")
    p.add_argument("--device", default="cpu", help="torch device of the cache (e.g. cuda:1)")
    p.add_argument("--dtype", default="float32", help="dtype of the cache (float32, bfloat16, float16)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    shape = [int(x) for x in a.shape.split(",")]
    kv_cache = torch.zeros(*shape, dtype=getattr(torch, a.dtype), device=a.device)
    if kv_cache.device.type == "cuda":
        torch.cuda.set_device(kv_cache.device)  # torch_dist receives NCCL tensors on the current device
    kv_cache.fill_(0.0)  # touch every page before any timing
    table = TransferTable(kv_cache)
    sink = TableSink(table)
    server = grpc.server(ThreadPoolExecutor(a.grpc_workers), options=kv_server_options(a.max_chunk_bytes))
    attach_receiver(KvTransferConfig(transport="torch_dist"), server, sink)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        FLOOR_SERVICE, {"Push": grpc.stream_unary_rpc_method_handler(_drop_messages)}),))
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    raw = RawTcpServer(a.raw_bytes)

    def reply(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    reply({"grpc_port": grpc_port, "tcp_port": raw.port, "pid": os.getpid()})
    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg["cmd"]
        if cmd == "open":
            ids = list(range(shape[2] - 1, shape[2] - 1 - msg["num_blocks"], -1))
            gen = table.open(msg["transfer_id"], msg["request_id"], ids, time.monotonic() + 600)
            reply({"generation": gen, "block_ids": ids})
        elif cmd == "completed":
            reply({"completed": msg["transfer_id"] in sink.completed, "failed": sink.failed.get(msg["transfer_id"])})
        elif cmd == "digest":
            blocks = gather_blocks(kv_cache, 0, shape[0], msg["block_ids"])
            reply({"crc32": zlib.crc32(blocks.reshape(-1).view(torch.uint8).cpu().numpy())})
        elif cmd == "raw_buffer":
            raw.buffer = bytearray(msg["nbytes"])
            raw.buffer[::4096] = b"\0" * len(raw.buffer[::4096])  # touch every page before timing
            reply({"ok": True})
        elif cmd == "quit":
            break
    server.stop(grace=1.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
