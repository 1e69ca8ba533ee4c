"""A fault-injecting KV transport for the tests, registered as ``"faulty"`` around another transport.

It is loaded like any transport from outside the package, as the module ``tests.kv_faults``
(importable from the repository root, where the test run and a local cluster's Ray workers
start; see ``FAULTY_MODULE`` in ``kv_helpers``)::

    KvTransferConfig(transport="faulty", transport_module="tests.kv_faults",
                     transport_options={"inner": "grpc", "fault": "corrupt", "chunk": "1"})
    pdcluster up ... --kv-transport faulty --kv-transport-module tests.kv_faults \\
        --kv-transport-option fault=delay --kv-transport-option delay_s=0.15

Options (strings, as ``--kv-transport-option`` gives them):

* ``inner``: the wrapped transport (default ``"grpc"``); ``inner.KEY=VALUE`` goes to it as ``KEY=VALUE``.
* ``fault``: ``drop``, ``corrupt``, ``duplicate`` or ``delay`` (required).
* ``chunk``: 0-based index of the ``"kv"`` chunk of a transfer the fault hits, or ``all`` (default).
* ``delay_s``: seconds ``delay`` holds each chunk it hits (required for ``delay``, >= 0).
* ``transfers``: fault only the first N transfers of each sender (default: every one).

How: the sender is the inner transport's, with each destination's endpoint swapped for a
relay, a ``KvTransfer`` gRPC server in the sender's process (on 127.0.0.1) that forwards each
``PushKv`` stream to the real endpoint, applies the fault to its ``"kv"`` chunks on the way,
and hands the receiver's ack back. The receiver is the inner transport's, unchanged. Tensors
that travel outside the message (``torch_dist``) still go straight to the receiver (so
sender and receiver must share a host); only their chunk's header passes the relay.

Outcomes, each a :class:`kvtransfer.KvTransferError` on the sender and nothing completed on
the receiver (tests/test_kv_faults.py):

* ``drop``: refused, ``"incomplete: sender sent N chunks, N-1 received"`` (the receiver learns
  of the gap from the ``"done"`` chunk: later chunks were written, the sink's ``fail`` frees them);
* ``corrupt``: one payload byte flipped (tensor inside the message) or the header's CRC32
  changed (tensor over ``torch_dist``): refused at that chunk, ``"corrupt: checksum mismatch"``;
* ``duplicate``: the chunk forwarded twice: the first copy is written, the second refused,
  ``"corrupt: tokens of [a, b) of layer l sent twice"``;
* ``delay``: longer than the sender's ``timeout_s``: timeout (``DEADLINE_EXCEEDED`` on the
  sender; the receiver fails the transfer as ``"incomplete:"`` if it had admitted it, else
  the reservation waits for its lease); past the reservation's lease: refused as ``"stale:"``
  (nothing of it written, ``fail`` not called); shorter than both: only slower.

With ``torch_dist`` inside, a dropped or duplicated header leaves its tensor without (or
with an extra) matching receive: such a transfer times out instead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import msgpack
import torch

from kvtransfer import KvReceiver, KvReceiverSink, KvSender, LayerProgress, SendResult, TransferState
from kvtransfer.registry import ChannelFactory, get_transport, register_transport
from kvtransfer.wire import KIND_KV
from pdcluster.v1 import kv_pb2, kv_pb2_grpc

if __name__ != "tests.kv_faults":  # a second copy would register "faulty" twice
    raise ImportError(f"import the fault-injecting KV transport as tests.kv_faults, not {__name__}")

NAME = "faulty"
FAULTS = ("drop", "corrupt", "duplicate", "delay")
_KEYS = ("inner", "fault", "chunk", "delay_s", "transfers")
_UNLIMITED = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


@dataclass(frozen=True)
class FaultSpec:
    """The parsed options (see the module docstring); ``chunk``/``transfers`` ``None`` = every one."""

    inner: str
    inner_options: dict[str, str]
    fault: str
    chunk: int | None
    delay_s: float
    transfers: int | None

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> FaultSpec:
        """Raises ``ValueError`` for an unknown key, a missing ``fault`` or a value out of range."""
        inner_options = {k.removeprefix("inner."): v for k, v in options.items() if k.startswith("inner.")}
        unknown = sorted(k for k in options if not k.startswith("inner.") and k not in _KEYS)
        if unknown:
            raise ValueError(f"KV transport {NAME!r} takes no option {unknown}; it takes {list(_KEYS)} and inner.*")
        fault = options.get("fault")
        if fault not in FAULTS:
            raise ValueError(f"option fault must be one of {FAULTS}, got {fault!r}")
        chunk = None if options.get("chunk", "all") == "all" else int(options["chunk"])
        transfers = int(options["transfers"]) if "transfers" in options else None
        if fault == "delay" and "delay_s" not in options:
            raise ValueError("fault=delay needs option delay_s")
        delay_s = float(options.get("delay_s", "0"))
        if (chunk is not None and chunk < 0) or delay_s < 0 or (transfers is not None and transfers < 0):
            raise ValueError(f"chunk, delay_s and transfers must be >= 0, got {chunk}, {delay_s}, {transfers}")
        return cls(options.get("inner", "grpc"), inner_options, fault, chunk, delay_s, transfers)

    def apply(self, chunks: Iterator[kv_pb2.KvChunk]) -> Iterator[kv_pb2.KvChunk]:
        """The stream ``chunks`` with the fault applied; ends when the sender's stream breaks."""
        index = 0
        try:
            for chunk in chunks:
                header = msgpack.unpackb(chunk.header, raw=False, strict_map_key=False)
                hit = header["kind"] == KIND_KV and self.chunk in (None, index)
                index += header["kind"] == KIND_KV
                if not hit:
                    yield chunk
                    continue
                if self.fault == "delay":
                    time.sleep(self.delay_s)
                if self.fault == "corrupt":
                    chunk = _corrupt(chunk, header)
                if self.fault != "drop":
                    yield chunk
                if self.fault == "duplicate":
                    yield chunk
        except grpc.RpcError:  # the sender cancelled or its deadline passed: end the stream here too
            return


def _corrupt(chunk: kv_pb2.KvChunk, header: dict[str, Any]) -> kv_pb2.KvChunk:
    """The chunk with one payload byte flipped, or with another CRC32 in its header when it has no payload."""
    if chunk.payload:
        payload = bytearray(chunk.payload)
        payload[len(payload) // 2] ^= 0xFF
        return kv_pb2.KvChunk(header=chunk.header, payload=bytes(payload))
    return kv_pb2.KvChunk(header=msgpack.packb({**header, "checksum": header["checksum"] ^ 0xFF}), payload=b"")


class _Relay(kv_pb2_grpc.KvTransferServicer):
    """A local ``KvTransfer`` server forwarding every ``PushKv`` stream to ``upstream`` through ``spec``,
    on a channel opened by the sender's ``connect`` (so it carries the sender's credentials)."""

    def __init__(self, upstream: str, spec: FaultSpec, connect: ChannelFactory) -> None:
        self._spec = spec
        self._channel = connect(upstream, _UNLIMITED)
        self._stub = kv_pb2_grpc.KvTransferStub(self._channel)
        self._server = grpc.server(ThreadPoolExecutor(max_workers=16), options=_UNLIMITED)
        kv_pb2_grpc.add_KvTransferServicer_to_server(self, self._server)
        self.endpoint = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def PushKv(self, request_iterator, context):
        try:
            return self._stub.PushKv(self._spec.apply(request_iterator), timeout=context.time_remaining())
        except grpc.RpcError as exc:
            context.abort(exc.code(), exc.details())

    def close(self) -> None:
        self._server.stop(0)
        self._channel.close()


@dataclass(frozen=True)
class _Via:
    """A :class:`kvtransfer.KvDestinationLike` with another ``kv_endpoint``."""

    worker_id: str
    kv_endpoint: str
    block_ids: Sequence[int]
    block_size: int
    generation: int
    dtype: str


class FaultySender(KvSender):
    """The inner transport's sender, its transfers (the first ``spec.transfers``) sent through relays."""

    def __init__(self, inner: KvSender, spec: FaultSpec, connect: ChannelFactory) -> None:
        self._inner = inner
        self._spec = spec
        self._connect = connect
        self._lock = threading.Lock()
        self._relays: dict[str, _Relay] = {}
        self._sent = 0

    def send(self, request_id: str, transfer_id: str, dest: Any, kv_cache: torch.Tensor,
             src_block_ids: Sequence[int], first_token_id: int | None,
             first_token_logprobs: dict[Any, Any] | None = None, layers_per_chunk: int = 1, *,
             progress: LayerProgress | None = None) -> SendResult:
        with self._lock:
            faulty = self._spec.transfers is None or self._sent < self._spec.transfers
            self._sent += 1
            if faulty and dest.kv_endpoint not in self._relays:
                self._relays[dest.kv_endpoint] = _Relay(dest.kv_endpoint, self._spec, self._connect)
            relay = self._relays[dest.kv_endpoint] if faulty else None
        if relay is not None:
            dest = _Via(dest.worker_id, relay.endpoint, list(dest.block_ids), dest.block_size, dest.generation,
                        dest.dtype)
        return self._inner.send(request_id, transfer_id, dest, kv_cache, src_block_ids, first_token_id,
                                first_token_logprobs, layers_per_chunk, progress=progress)

    def poll(self, transfer_id: str) -> TransferState:
        return self._inner.poll(transfer_id)

    def close(self) -> None:
        self._inner.close()
        with self._lock:
            relays, self._relays = list(self._relays.values()), {}
        for relay in relays:
            relay.close()


def _sender(*, timeout_s: float, max_chunk_bytes: int, options: Mapping[str, str],
            connect: ChannelFactory) -> FaultySender:
    spec = FaultSpec.parse(options)
    inner = get_transport(spec.inner).sender_factory(timeout_s=timeout_s, max_chunk_bytes=max_chunk_bytes,
                                                     options=spec.inner_options, connect=connect)
    return FaultySender(inner, spec, connect)


def _receiver(server: grpc.Server, sink: KvReceiverSink, *, options: Mapping[str, str]) -> KvReceiver:
    spec = FaultSpec.parse(options)
    return get_transport(spec.inner).receiver_factory(server, sink, options=spec.inner_options)


register_transport(NAME, sender_factory=_sender, receiver_factory=_receiver)
