"""The messages of ``KvTransfer.PushKv`` framed by hand: header and payload without a protobuf copy.

Each message on the wire is a valid :class:`pdcluster.v1.kv_pb2.KvChunk` encoding (field 1
``header``, field 2 ``payload``, both length-delimited), so the ``.proto`` stays the schema and
a stub built from it still talks to a receiver and a sender of this module. But neither side
builds a ``KvChunk`` around the payload:

* the sender's request serializer (:func:`frame_bytes`) writes the two field tags, the
  lengths, the header and the payload straight into the one ``bytes`` object gRPC takes
  (gRPC Python accepts nothing else): one copy of the payload, from the gathered blocks;
* the receiver's request deserializer (:func:`parse_frame`) returns a :class:`KvFrame` whose
  ``payload`` is a ``memoryview`` into the message gRPC hands over: the tensor the sink
  writes into the reserved blocks is a view of it, so the one copy after gRPC's is that write.

:func:`parse_frame` never raises (gRPC would answer a raising deserializer with a bare
``INTERNAL``): a malformed message becomes a frame with an ``error``, which
:func:`kvtransfer.wire.decode_chunk` refuses as corrupt.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from pdcluster.v1 import kv_pb2

SERVICE = kv_pb2.DESCRIPTOR.services_by_name["KvTransfer"].full_name
PUSH_KV = f"/{SERVICE}/PushKv"
_HEADER_TAG, _PAYLOAD_TAG = b"\x0a", b"\x12"  # (field << 3) | 2: length-delimited fields 1 and 2


@dataclass(frozen=True, slots=True)
class KvFrame:
    """One ``PushKv`` message.

    Attributes:
        header: the msgpack header (:mod:`kvtransfer.wire`).
        payload: the tensor's C-order bytes: ``bytes`` or a 1-d unsigned-byte ``memoryview``
            (a view of the sender's gathered blocks, or into the received message).
        error: why the received message could not be split into header and payload
            (``header`` and ``payload`` are then empty), else ``None``.
    """

    header: bytes
    payload: bytes | memoryview = b""
    error: str | None = None


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def frame_bytes(frame: KvFrame | kv_pb2.KvChunk | bytes) -> bytes:
    """The wire bytes of ``frame`` (the ``KvChunk`` encoding): the request serializer of ``PushKv``.

    ``bytes`` are taken as framed already (the sender frames chunks on its producer thread); a
    ``kv_pb2.KvChunk`` (a relay forwarding what it parsed) is serialized by protobuf.
    """
    if isinstance(frame, bytes):
        return frame
    if isinstance(frame, kv_pb2.KvChunk):
        return frame.SerializeToString()
    header, payload = frame.header, frame.payload
    n = payload.nbytes if isinstance(payload, memoryview) else len(payload)
    return b"".join((frame_prefix(header, n)[0], payload))


def frame_prefix(header: bytes, payload_nbytes: int) -> tuple[bytes, int]:
    """The wire bytes of a frame up to its payload (the header field, then the payload field's tag
    and length for ``payload_nbytes`` bytes), and the offset in them where ``header`` ends."""
    head = _HEADER_TAG + _varint(len(header)) + header
    return head + _PAYLOAD_TAG + _varint(payload_nbytes), len(head)


def _read_varint(data: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated or overlong varint")
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _skip(data: memoryview, pos: int, wire_type: int) -> int:
    if wire_type == 0:
        return _read_varint(data, pos)[1]
    size = {1: 8, 5: 4}.get(wire_type)
    if wire_type == 2:
        size, pos = _read_varint(data, pos)
    if size is None:
        raise ValueError(f"wire type {wire_type} is not allowed")
    if pos + size > len(data):
        raise ValueError("field runs past the end of the message")
    return pos + size


def parse_frame(data: bytes) -> KvFrame:
    """Split a received ``PushKv`` message into header and payload (no copy): the request deserializer.

    Fields other than 1 and 2 are skipped; of a repeated field the last one counts (as protobuf
    does). Never raises: a malformed message gives a frame whose ``error`` says why.
    """
    view = memoryview(data)
    fields: dict[int, memoryview] = {}
    pos = 0
    try:
        while pos < len(view):
            key, pos = _read_varint(view, pos)
            number, wire_type = key >> 3, key & 7
            if number in (1, 2) and wire_type == 2:
                size, pos = _read_varint(view, pos)
                if pos + size > len(view):
                    raise ValueError(f"field {number} of {size} bytes runs past the end of the message")
                fields[number] = view[pos:pos + size]
                pos += size
            else:
                pos = _skip(view, pos, wire_type)
    except ValueError as exc:
        return KvFrame(b"", b"", f"malformed KvChunk message ({len(view)} bytes): {exc}")
    return KvFrame(bytes(fields.get(1, b"")), fields.get(2, b""))


def push_kv(channel: grpc.Channel) -> grpc.StreamUnaryMultiCallable:
    """The ``PushKv`` client call on ``channel``: a stream of :class:`KvFrame` (or framed ``bytes``, or
    ``KvChunk``) to a ``KvAck``."""
    return channel.stream_unary(PUSH_KV, request_serializer=frame_bytes,
                                response_deserializer=kv_pb2.KvAck.FromString)


def add_push_kv_handler(server: grpc.Server,
                        behavior: Callable[[Any, grpc.ServicerContext], kv_pb2.KvAck]) -> None:
    """Serve ``PushKv`` on ``server`` (before it starts) with ``behavior(frames, context) -> KvAck``,
    its request iterator yielding :class:`KvFrame` from :func:`parse_frame`."""
    handler = grpc.stream_unary_rpc_method_handler(behavior, request_deserializer=parse_frame,
                                                   response_serializer=kv_pb2.KvAck.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"PushKv": handler}),))
