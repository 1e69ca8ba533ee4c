"""gRPC KV receiver: the ``KvTransfer.PushKv`` servicer that verifies chunks and writes them through a sink."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import grpc
import torch

from kvtransfer.errors import KvIntegrityError, StaleTransferError
from kvtransfer.states import TransferState, TransferStateTable
from kvtransfer.transport import KvReceiver, KvReceiverSink
from kvtransfer.wire import KIND_KV, decode_chunk
from pdcluster.v1 import kv_pb2, kv_pb2_grpc

log = logging.getLogger(__name__)


class KvTransferServicer(kv_pb2_grpc.KvTransferServicer, KvReceiver):
    """Receives one transfer per ``PushKv`` stream and writes it through ``sink``.

    Per stream: every chunk is decoded and verified (header, dtype, size,
    CRC32); the first one is admitted with ``sink.begin``; each ``"kv"`` chunk
    is written with ``sink.write``; the ``"done"`` chunk is accepted only if
    its ``num_chunks`` matches and every layer ``[0, num_layers)`` was written
    for the same set of blocks, each exactly once, then ``sink.complete`` runs.

    Acks: ``ok=True`` with ``bytes_received`` (payload bytes) after
    ``complete``. ``ok=False`` with an ``error`` starting ``"stale:"`` when the
    sink does not (or no longer) hold the reservation (chunks dropped, nothing
    written, ``sink.fail`` not called), or another reason (``"corrupt:"``,
    ``"incomplete:"``, ``"sink error:"``) after ``sink.fail`` was called.

    Receiver state per accepted transfer (:meth:`poll`): ``TRANSFERRING`` from
    the first accepted chunk, then ``SUCCESS`` or ``FAILED``.

    Args:
        sink: the decode worker's :class:`KvReceiverSink`.
        state_history: finished transfers kept for :meth:`poll`.
    """

    def __init__(self, sink: KvReceiverSink, *, state_history: int = 4096) -> None:
        self._sink = sink
        self._states = TransferStateTable(state_history)

    def PushKv(self, request_iterator: Iterator[kv_pb2.KvChunk], context: grpc.ServicerContext) -> kv_pb2.KvAck:
        """Handle one transfer stream; see the class docstring for the ack contract."""
        stream = _InboundStream(self._sink, self._states)
        try:
            for chunk in request_iterator:
                ack = stream.on_chunk(chunk)
                if ack is not None:
                    return ack
        except grpc.RpcError:
            return stream.fail("incomplete: the sender cancelled the stream or its deadline expired")
        return stream.fail("incomplete: the stream ended before its done chunk")

    def poll(self, transfer_id: str) -> TransferState:
        """See :meth:`KvReceiver.poll`."""
        return self._states.get(transfer_id)


def add_kv_transfer_servicer(
    server: grpc.Server, sink: KvReceiverSink, *, state_history: int = 4096
) -> KvTransferServicer:
    """Register a :class:`KvTransferServicer` for ``sink`` on ``server`` (before ``server.start()``).

    Returns:
        The servicer, whose :meth:`KvTransferServicer.poll` shows receiver states.
    """
    servicer = KvTransferServicer(sink, state_history=state_history)
    kv_pb2_grpc.add_KvTransferServicer_to_server(servicer, server)
    return servicer


class _InboundStream:
    """State of one ``PushKv`` stream (one transfer)."""

    def __init__(self, sink: KvReceiverSink, states: TransferStateTable) -> None:
        self._sink = sink
        self._states = states
        self.transfer_id: str | None = None
        self.generation: int | None = None
        self._num_chunks = 0
        self._bytes = 0
        self._coverage: dict[int, set[int]] = {}

    def on_chunk(self, chunk: kv_pb2.KvChunk) -> kv_pb2.KvAck | None:
        """Process one chunk; return the final ack to end the stream, ``None`` to read on."""
        try:
            header, tensor = decode_chunk(chunk)
        except KvIntegrityError as exc:
            if self.transfer_id is None and exc.header is not None and not self._admit(exc.header):
                return _stale(exc.header)
            return self.fail(f"corrupt: {exc}")
        if self.transfer_id is None:
            if not self._admit(header):
                return _stale(header)
        elif (header["transfer_id"], header["generation"]) != (self.transfer_id, self.generation):
            return self.fail(
                f"corrupt: chunk of transfer {header['transfer_id']!r} generation "
                f"{header['generation']} in the stream of {self.transfer_id!r} generation {self.generation}"
            )
        if header["kind"] == KIND_KV:
            return self._on_kv(header, tensor, len(chunk.payload))
        return self._on_done(header)

    def fail(self, reason: str) -> kv_pb2.KvAck:
        """Fail the admitted transfer (if any) through the sink and build the error ack."""
        if self.transfer_id is not None:
            log.warning("KV transfer %s generation %s failed: %s", self.transfer_id, self.generation, reason)
            self._states.set(self.transfer_id, TransferState.FAILED)
            try:
                self._sink.fail(self.transfer_id, self.generation, reason)
            except Exception:
                log.exception("sink.fail raised for transfer %s", self.transfer_id)
        return kv_pb2.KvAck(ok=False, error=reason, bytes_received=self._bytes)

    def _admit(self, header: dict[str, Any]) -> bool:
        tid, gen, rid = header.get("transfer_id"), header.get("generation"), header.get("request_id")
        if not (isinstance(tid, str) and isinstance(gen, int) and isinstance(rid, str)):
            return False
        try:
            admitted = bool(self._sink.begin(tid, gen, rid))
        except Exception:
            log.exception("sink.begin raised for transfer %s", tid)
            return False
        if admitted:
            self.transfer_id, self.generation = tid, gen
            self._states.set(tid, TransferState.TRANSFERRING)
        return admitted

    def _on_kv(self, header: dict[str, Any], tensor: torch.Tensor, nbytes: int) -> kv_pb2.KvAck | None:
        ls, le, ids = header["layer_start"], header["layer_end"], header["block_ids"]
        for layer in range(ls, le):
            if not self._coverage.get(layer, set()).isdisjoint(ids):
                return self.fail(f"corrupt: blocks of layer {layer} sent twice")
        try:
            self._sink.write(self.transfer_id, self.generation, ls, le, ids, tensor)
        except StaleTransferError as exc:
            return self._stale_now(exc)
        except Exception as exc:
            log.exception("sink.write raised for transfer %s", self.transfer_id)
            return self.fail(f"sink error: {type(exc).__name__}: {exc}")
        for layer in range(ls, le):
            self._coverage.setdefault(layer, set()).update(ids)
        self._num_chunks += 1
        self._bytes += nbytes
        return None

    def _on_done(self, header: dict[str, Any]) -> kv_pb2.KvAck:
        if header["num_chunks"] != self._num_chunks:
            return self.fail(
                f"incomplete: sender sent {header['num_chunks']} chunks, {self._num_chunks} received"
            )
        num_layers = header["num_layers"]
        blocks = self._coverage.get(0)
        if set(self._coverage) != set(range(num_layers)) or any(s != blocks for s in self._coverage.values()):
            return self.fail(f"incomplete: layers x blocks of {num_layers} layers not fully covered")
        try:
            self._sink.complete(
                self.transfer_id, self.generation, header["first_token_id"], header["first_token_logprobs"]
            )
        except StaleTransferError as exc:
            return self._stale_now(exc)
        except Exception as exc:
            log.exception("sink.complete raised for transfer %s", self.transfer_id)
            return self.fail(f"sink error: {type(exc).__name__}: {exc}")
        self._states.set(self.transfer_id, TransferState.SUCCESS)
        return kv_pb2.KvAck(ok=True, bytes_received=self._bytes)

    def _stale_now(self, exc: StaleTransferError) -> kv_pb2.KvAck:
        log.info("KV transfer %s generation %s went stale: %s", self.transfer_id, self.generation, exc)
        self._states.set(self.transfer_id, TransferState.FAILED)
        return kv_pb2.KvAck(ok=False, error=f"stale: {exc}", bytes_received=self._bytes)


def _stale(header: dict[str, Any]) -> kv_pb2.KvAck:
    tid, gen = header.get("transfer_id"), header.get("generation")
    log.info("dropping stream of unreserved KV transfer %r generation %r", tid, gen)
    return kv_pb2.KvAck(
        ok=False, error=f"stale: transfer {tid!r} generation {gen!r} is not reserved here; chunks dropped"
    )
