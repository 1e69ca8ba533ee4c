"""gRPC KV receiver: the ``KvTransfer.PushKv`` servicer that verifies chunks and writes them through a sink.

Lifecycle of a stream (one transfer): the first chunk is admitted by the sink (its
transfer id and generation still reserved), each ``"kv"`` chunk is verified and written,
the ``"done"`` chunk checks coverage and completes the transfer; anything else fails it
(or, for an unreserved transfer, drops it as stale). Where a chunk's tensor comes from
is the data plane's business (:class:`ReceiveDataPlane`): inside the message for the
``"grpc"`` transport (:class:`InlineReceive`), or what another transport supplies
(``"torch_dist"``: :mod:`kvtransfer.dist_transport`).

Copies: the messages arrive as :class:`~kvtransfer.frames.KvFrame` straight from gRPC's
bytes (:func:`~kvtransfer.frames.parse_frame`, no protobuf message); a chunk's CRC32C is read
from those bytes in place and the sink gets a read-only tensor view of them, so its write
into the reserved blocks is the only copy of the payload after gRPC's own.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import torch

from kvtransfer.coverage import TokenCoverage
from kvtransfer.errors import KvDataPlaneError, KvIntegrityError, StaleTransferError
from kvtransfer.frames import KvFrame, add_push_kv_handler
from kvtransfer.memory import keep_freed_memory
from kvtransfer.states import TransferState, TransferStateTable
from kvtransfer.transport import KvReceiver, KvReceiverSink
from kvtransfer.wire import KIND_KV, decode_chunk
from pdcluster.v1 import kv_pb2

log = logging.getLogger(__name__)


class InboundData(Protocol):
    """The data plane of one ``PushKv`` stream."""

    def note(self, header: dict[str, Any]) -> None:
        """Every header of the stream that parsed, also of a chunk that then failed verification."""

    def prepare(self, header: dict[str, Any]) -> None:
        """A verified header, once the stream's first chunk was admitted, as soon as its message arrived
        (on the stream's read-ahead thread, before :meth:`note` and :meth:`tensor` see it on the
        handler's): a data plane may start receiving the chunk's tensor now (a header of another transfer
        then fails the stream, which calls :meth:`drop`). Must not raise (:meth:`tensor` reports failures)."""

    def tensor(self, header: dict[str, Any]) -> torch.Tensor:
        """The tensor of a verified ``"kv"`` chunk whose message carries none (an empty payload).

        Returns:
            A tensor of ``header["shape"]`` and ``header["dtype"]`` whose CRC32C matched the header.

        Raises:
            KvIntegrityError: no such tensor, or it does not match the header (the transfer is corrupt).
            KvDataPlaneError: receiving it failed or timed out (the transfer is incomplete).
        """

    def drop(self) -> None:
        """The stream's transfer failed or was refused: release what the stream used. Must not raise."""


class ReceiveDataPlane(Protocol):
    """A receiver's data plane (:class:`KvTransferServicer` takes one): one :class:`InboundData` per stream."""

    def open_stream(self) -> InboundData:
        """The data plane of a new ``PushKv`` stream."""


class InlineReceive:
    """The ``"grpc"`` data plane: every tensor travels inside its message (stateless)."""

    def open_stream(self) -> InboundData:
        """See :meth:`ReceiveDataPlane.open_stream`."""
        return self

    def note(self, header: dict[str, Any]) -> None:
        """Nothing to note."""

    def prepare(self, header: dict[str, Any]) -> None:
        """Nothing to prepare."""

    def tensor(self, header: dict[str, Any]) -> torch.Tensor:
        """Always raises :class:`KvIntegrityError`: this receiver takes no tensor outside the message."""
        raise KvIntegrityError(f"chunk without payload (data={header.get('data')!r}): this KV receiver takes "
                               "tensors inside the message only", header)

    def drop(self) -> None:
        """Nothing to release."""


class KvTransferServicer(KvReceiver):
    """Receives one transfer per ``PushKv`` stream and writes it through ``sink``.

    Per stream: every chunk is decoded and verified (wire version, header, dtype,
    size, CRC32C); the first one is admitted with ``sink.begin``; each ``"kv"`` chunk
    is written with ``sink.write`` (its tensor a read-only view of the message, or for
    a chunk without payload from the data plane, CRC-checked alike); the
    ``"done"`` chunk is accepted only if its ``num_chunks`` matches and every
    layer ``[0, num_layers)`` covers the same token range ``[0, T)``, each token
    exactly once, then ``sink.complete`` runs. A stream that ends otherwise
    tells its data plane to drop what it used (e.g. a pair group).

    Acks: ``ok=True`` with ``bytes_received`` (payload bytes) after
    ``complete``. ``ok=False`` with an ``error`` starting ``"stale:"`` when the
    sink does not (or no longer) hold the reservation (chunks dropped, nothing
    written, ``sink.fail`` not called), or another reason (``"corrupt:"``,
    ``"incomplete:"``, ``"sink error:"``) after ``sink.fail`` was called.

    Receiver state per accepted transfer (:meth:`poll`): ``TRANSFERRING`` from
    the first accepted chunk, then ``SUCCESS`` or ``FAILED``.

    Args:
        sink: the decode worker's :class:`KvReceiverSink`.
        data_plane: where tensors of chunks without payload come from;
            :class:`InlineReceive` (none: such chunks are corrupt) by default.
        state_history: finished transfers kept for :meth:`poll`.
    """

    def __init__(
        self, sink: KvReceiverSink, *, data_plane: ReceiveDataPlane | None = None, state_history: int = 4096
    ) -> None:
        self._sink = sink
        self._states = TransferStateTable(state_history)
        self._data = data_plane if data_plane is not None else InlineReceive()

    def PushKv(self, request_iterator: Iterator[KvFrame], context: grpc.ServicerContext) -> kv_pb2.KvAck:
        """Handle one transfer stream; see the class docstring for the ack contract.

        A reader thread takes the next message from gRPC (its copy out of gRPC's buffers) and
        verifies it (:func:`~kvtransfer.wire.decode_chunk`: header, CRC32C) while this one writes
        the current one.
        """
        stream = _InboundStream(self._sink, self._states, self._data.open_stream())
        with _ReadAhead(request_iterator, stream.decode) as chunks:
            try:
                for chunk in chunks:
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
    server: grpc.Server, sink: KvReceiverSink, data_plane: ReceiveDataPlane | None = None
) -> KvTransferServicer:
    """Register a :class:`KvTransferServicer` for ``sink`` on ``server`` (before ``server.start()``), its
    ``PushKv`` reading hand-framed messages (:func:`kvtransfer.frames.add_push_kv_handler`).

    The receiver factories of the transports with this control plane call it
    (:mod:`kvtransfer.grpc_transport`, :mod:`kvtransfer.dist_transport`).

    Returns:
        The servicer, whose :meth:`KvTransferServicer.poll` shows receiver states.
    """
    keep_freed_memory()
    servicer = KvTransferServicer(sink, data_plane=data_plane)
    add_push_kv_handler(server, servicer.PushKv)
    return servicer


class _ReadAhead:
    """Iterates a request iterator one message ahead on a thread of its own, each message mapped
    through ``decode`` there (a context manager: leaving it lets the thread end); an exception of
    the iterator is raised in the consumer."""

    _END = object()

    def __init__(self, requests: Iterator[KvFrame], decode: Callable[[KvFrame], object]) -> None:
        self._requests = requests
        self._decode = decode
        self._ready: queue.Queue = queue.Queue(maxsize=1)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True, name="kv-read-ahead")

    def __enter__(self) -> Iterator[KvFrame]:
        self._thread.start()
        return self._frames()

    def __exit__(self, *exc: object) -> None:
        self._closed.set()

    def _read(self) -> None:
        item: object = self._END
        try:
            for frame in self._requests:
                if not self._put(self._decode(frame)):
                    return
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            item = exc
        self._put(item)

    def _put(self, item: object) -> bool:
        while not self._closed.is_set():
            try:
                self._ready.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _frames(self) -> Iterator[Any]:
        while True:
            item = self._ready.get()
            if item is self._END:
                return
            if isinstance(item, Exception):
                raise item
            yield item


@dataclass(frozen=True, slots=True)
class _Decoded:
    """One message as :meth:`_InboundStream.decode` left it: ``header`` (``None`` when it did not
    parse) and ``tensor`` (``None`` for ``"done"`` and tensor-less chunks), or the ``error``."""

    header: dict[str, Any] | None
    tensor: torch.Tensor | None
    error: KvIntegrityError | None


class _InboundStream:
    """State of one ``PushKv`` stream (one transfer)."""

    def __init__(self, sink: KvReceiverSink, states: TransferStateTable, data: InboundData) -> None:
        self._sink = sink
        self._states = states
        self._data = data
        self.transfer_id: str | None = None
        self.generation: int | None = None
        self.request_id = ""  # of the admitted transfer (named in its failure line)
        self._num_chunks = 0
        self._bytes = 0
        self._block_size: int | None = None
        self._coverage = TokenCoverage()
        self._admitted = threading.Event()

    def decode(self, frame: KvFrame) -> _Decoded:
        """Parse and verify one message (on the read-ahead thread); once the transfer is admitted,
        let the data plane start on the chunk's tensor (:meth:`InboundData.prepare`)."""
        try:
            header, tensor = decode_chunk(frame, copy=False)
        except KvIntegrityError as exc:
            return _Decoded(exc.header, None, exc)
        if self._admitted.is_set():
            self._data.prepare(header)
        return _Decoded(header, tensor, None)

    def on_chunk(self, chunk: _Decoded) -> kv_pb2.KvAck | None:
        """Process one decoded chunk; return the final ack to end the stream, ``None`` to read on."""
        header, tensor, exc = chunk.header, chunk.tensor, chunk.error
        if exc is not None:
            if header is not None:
                self._data.note(header)
            if self.transfer_id is None and header is not None and not self._admit(header):
                return self._stale(header)
            return self.fail(f"corrupt: {exc}")
        self._data.note(header)
        if self.transfer_id is None:
            if not self._admit(header):
                return self._stale(header)
        elif (header["transfer_id"], header["generation"]) != (self.transfer_id, self.generation):
            return self.fail(
                f"corrupt: chunk of transfer {header['transfer_id']!r} generation "
                f"{header['generation']} in the stream of {self.transfer_id!r} generation {self.generation}"
            )
        if header["kind"] != KIND_KV:
            return self._on_done(header)
        if tensor is None:  # the tensor travels outside the message
            try:
                tensor = self._data.tensor(header)
            except KvIntegrityError as exc:
                return self.fail(f"corrupt: {exc}")
            except KvDataPlaneError as exc:
                return self.fail(f"incomplete: data plane: {exc}")
        return self._on_kv(header, tensor, tensor.numel() * tensor.element_size())

    def fail(self, reason: str) -> kv_pb2.KvAck:
        """Fail the admitted transfer (if any) through the sink and build the error ack."""
        self._data.drop()
        if self.transfer_id is not None:
            log.warning("KV transfer %s generation %s failed: %s", self.transfer_id, self.generation, reason,
                        extra={"request_id": self.request_id})
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
            self.transfer_id, self.generation, self.request_id = tid, gen, rid
            self._states.set(tid, TransferState.TRANSFERRING)
            self._admitted.set()
        return admitted

    def _on_kv(self, header: dict[str, Any], tensor: torch.Tensor, nbytes: int) -> kv_pb2.KvAck | None:
        ls, le, ids = header["layer_start"], header["layer_end"], header["block_ids"]
        bs, ts = header["block_size"], header["token_start"]
        te = ts + header["shape"][2] * bs
        if self._block_size is None:
            self._block_size = bs
        elif bs != self._block_size:
            return self.fail(f"corrupt: block_size {bs} after {self._block_size} in one transfer")
        layer = self._coverage.overlap(ls, le, ts, te)
        if layer is not None:
            return self.fail(f"corrupt: tokens of [{ts}, {te}) of layer {layer} sent twice")
        try:
            self._sink.write(self.transfer_id, self.generation, ls, le, ids, tensor, token_start=ts)
        except StaleTransferError as exc:
            return self._stale_now(exc)
        except Exception as exc:
            log.exception("sink.write raised for transfer %s", self.transfer_id)
            return self.fail(f"sink error: {type(exc).__name__}: {exc}")
        self._coverage.add(ls, le, ts, te)
        self._num_chunks += 1
        self._bytes += nbytes
        return None

    def _on_done(self, header: dict[str, Any]) -> kv_pb2.KvAck:
        if header["num_chunks"] != self._num_chunks:
            return self.fail(
                f"incomplete: sender sent {header['num_chunks']} chunks, {self._num_chunks} received"
            )
        missing = self._coverage.missing(header["num_layers"])
        if missing is not None:
            return self.fail(f"incomplete: {missing}")
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
        self._data.drop()
        self._states.set(self.transfer_id, TransferState.FAILED)
        return kv_pb2.KvAck(ok=False, error=f"stale: {exc}", bytes_received=self._bytes)

    def _stale(self, header: dict[str, Any]) -> kv_pb2.KvAck:
        tid, gen = header.get("transfer_id"), header.get("generation")
        log.info("dropping stream of unreserved KV transfer %r generation %r", tid, gen)
        self._data.drop()
        return kv_pb2.KvAck(
            ok=False, error=f"stale: transfer {tid!r} generation {gen!r} is not reserved here; chunks dropped"
        )
