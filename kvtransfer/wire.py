"""Wire format of one KV chunk: a msgpack header plus the raw bytes of a tensor.

A transfer is a stream of ``"kv"`` chunks followed by one ``"done"`` chunk, each a
:class:`~kvtransfer.frames.KvFrame` (``header``, ``payload``) on the wire as a
:class:`pdcluster.v1.kv_pb2.KvChunk` encoding framed without protobuf (:mod:`kvtransfer.frames`).

Wire version :data:`WIRE_VERSION` (2): every header carries ``"v": 2`` and a receiver refuses
any other (version 1, without ``"v"``, checksummed with zlib's CRC32).

``"kv"`` header keys: ``v``, ``kind``, ``request_id``, ``transfer_id``, ``generation``,
``layer_start``, ``layer_end`` (layers ``[start, end)``), ``block_size``
(tokens per block, the sender's), ``token_start`` (position in the transfer of
the payload's first token: source block index times ``block_size``),
``block_ids`` (the destination block ids that the payload's token range
``[token_start, token_start + n * block_size)`` touches, in order, clipped to
the destination's capacity; see :mod:`kvtransfer.reblock`), ``dtype`` (torch
dtype name, e.g. ``"bfloat16"``), ``shape`` (payload tensor shape) and
``checksum``. The payload is the C-order bytes of the sender's blocks, a
``[layer_end - layer_start, 2, n, block_size, num_kv_heads, head_dim]`` tensor,
native (little-endian) byte order.

A ``"kv"`` header may add ``"data": "dist"``: its tensor then travels outside
the message (an empty payload) over a torch.distributed pair group, described
by the header's ``"dist"`` map: ``pair`` (pair group id), ``store``
(``host:port`` of the sender's TCPStore), ``backend`` (``"gloo"`` or
``"nccl"``), ``tag`` (point-to-point tag of this tensor) and ``timeout_s``
(group timeout, seconds); ``checksum`` is then the CRC32C of the tensor's bytes
(:func:`verify_tensor`). See :mod:`kvtransfer.dist_transport`.

``"done"`` header keys: ``v``, ``kind``, ``request_id``, ``transfer_id``,
``generation``, ``num_chunks`` (``"kv"`` chunks sent before it),
``num_layers`` (layers of the whole transfer, for the coverage check),
``first_token_id``, ``first_token_logprobs`` (msgpack-able dict or ``None``)
and ``checksum``; its payload is empty.

``checksum`` is the CRC32C (Castagnoli, :func:`kvtransfer.checksum.crc32c`: the hardware
instruction) of the payload bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from kvtransfer.checksum import crc32c
from kvtransfer.errors import KvIntegrityError
from kvtransfer.frames import KvFrame
from kvtransfer.payload import nbytes_of, tensor_from_payload, tensor_payload
from pdcluster.v1 import kv_pb2

WIRE_VERSION = 2
KIND_KV = "kv"
KIND_DONE = "done"
DATA_DIST = "dist"
DIST_BACKENDS = ("gloo", "nccl")

_FLOAT_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in vars(torch).values()
    if isinstance(d, torch.dtype) and d.is_floating_point
}


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a floating torch dtype, e.g. ``torch.bfloat16 -> "bfloat16"``.

    Raises:
        ValueError: ``dtype`` is not a floating dtype.
    """
    name = str(dtype).removeprefix("torch.")
    if _FLOAT_DTYPES.get(name) != dtype:
        raise ValueError(f"KV dtype must be floating point, got {dtype}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """Torch dtype for a wire name (inverse of :func:`dtype_name`).

    Raises:
        ValueError: unknown or non-floating dtype name.
    """
    try:
        return _FLOAT_DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown floating dtype name {name!r}") from None


@dataclass(frozen=True)
class KvChunkMeta:
    """Addressing of one ``"kv"`` chunk (everything in its header but what the tensor gives).

    Attributes:
        request_id: request whose KV this is.
        transfer_id: transfer the chunk belongs to.
        generation: reservation stamp from the receiver's ``KvDestination``.
        layer_start: first layer in the payload (inclusive).
        layer_end: last layer in the payload (exclusive).
        block_ids: destination block ids the payload's token range touches, in order.
        block_size: tokens per block of the payload (the sender's).
        token_start: position in the transfer of the payload's first token
            (a multiple of ``block_size``).
    """

    request_id: str
    transfer_id: str
    generation: int
    layer_start: int
    layer_end: int
    block_ids: Sequence[int]
    block_size: int
    token_start: int = 0


def _kv_header(meta: KvChunkMeta, dtype: torch.dtype, shape: Sequence[int], checksum: int) -> dict[str, Any]:
    want = (meta.layer_end - meta.layer_start, 2)
    if len(shape) != 6 or tuple(shape[:2]) != want or shape[3] != meta.block_size or min(shape) < 1:
        raise ValueError(
            f"tensor shape {tuple(shape)} does not match ({want[0]}, 2, n, {meta.block_size}, "
            "num_kv_heads, head_dim)"
        )
    if not meta.block_ids or meta.token_start < 0 or meta.token_start % meta.block_size:
        raise ValueError(
            f"need destination block ids and a token_start that is a multiple of {meta.block_size}, "
            f"got {list(meta.block_ids)} and {meta.token_start}"
        )
    return {
        "v": WIRE_VERSION,
        "kind": KIND_KV,
        "request_id": meta.request_id,
        "transfer_id": meta.transfer_id,
        "generation": int(meta.generation),
        "layer_start": int(meta.layer_start),
        "layer_end": int(meta.layer_end),
        "block_ids": [int(b) for b in meta.block_ids],
        "block_size": int(meta.block_size),
        "token_start": int(meta.token_start),
        "dtype": dtype_name(dtype),
        "shape": [int(n) for n in shape],
        "checksum": checksum,  # last: kv_header_template's placeholder ends the header
    }


_CHECKSUM_SLOT = b"\xce\xff\xff\xff\xff"  # msgpack uint32 0xffffffff: 4 big-endian bytes after the marker


def kv_header_template(meta: KvChunkMeta, dtype: torch.dtype, shape: Sequence[int]) -> bytes:
    """The msgpack header of a ``"kv"`` chunk whose checksum is filled in later: its last 4 bytes
    are the ``checksum`` value, a msgpack uint32 (big-endian), to be overwritten with the payload's
    CRC32C (a valid, if not the shortest, encoding of any 32-bit value).

    Raises:
        ValueError: as :func:`encode_kv_chunk`, for a tensor of ``dtype`` and ``shape``.
    """
    raw = msgpack.packb(_kv_header(meta, dtype, shape, 0xFFFFFFFF))
    assert raw.endswith(_CHECKSUM_SLOT), "checksum must be the header's last key"
    return raw


def encode_kv_chunk(meta: KvChunkMeta, tensor: torch.Tensor) -> KvFrame:
    """Build a ``"kv"`` chunk carrying ``tensor`` (sender blocks) for ``meta``'s layers and tokens.

    Args:
        meta: addressing of the chunk.
        tensor: ``[layer_end - layer_start, 2, n, block_size, num_kv_heads,
            head_dim]``, floating dtype, any device/strides.

    Returns:
        The chunk; its payload is a view of ``tensor``'s bytes (no copy for a contiguous
        CPU tensor: do not change ``tensor`` before the chunk was sent), of
        ``tensor.numel() * tensor.element_size()`` bytes.

    Raises:
        ValueError: ``tensor`` shape disagrees with ``meta``, its dtype is not
            floating point, ``meta`` has an empty or inverted range, no block
            ids, or a ``token_start`` that is not a multiple of ``block_size``.
    """
    payload = tensor_payload(tensor)
    header = kv_header_template(meta, tensor.dtype, tensor.shape)  # the one encoding both sender paths write
    return KvFrame(header[:-4] + crc32c(payload).to_bytes(4, "big"), payload)


def encode_dist_kv_chunk(meta: KvChunkMeta, tensor: torch.Tensor, dist: dict[str, Any],
                         checksum: int | None = None) -> KvFrame:
    """Build a ``"kv"`` chunk whose tensor travels over a pair group (``"data": "dist"``, empty payload).

    Args:
        meta: addressing of the chunk.
        tensor: as for :func:`encode_kv_chunk`; its CRC32C goes into the header.
        dist: the ``"dist"`` map (``pair``, ``store``, ``backend``, ``tag``,
            ``timeout_s``; see the module docstring).
        checksum: ``tensor``'s CRC32C when the caller took it already (as it gathered), else computed.

    Raises:
        ValueError: as :func:`encode_kv_chunk`.
    """
    header = _kv_header(meta, tensor.dtype, tensor.shape, crc32c(tensor) if checksum is None else checksum)
    header["data"] = DATA_DIST
    header["dist"] = dict(dist)
    return KvFrame(msgpack.packb(header))


def verify_tensor(header: dict[str, Any], tensor: torch.Tensor) -> None:
    """Check a tensor received outside the message against its (decoded) ``"kv"`` header.

    Raises:
        KvIntegrityError: dtype, shape or CRC32C differ from the header's.
    """
    if dtype_name(tensor.dtype) != header["dtype"] or list(tensor.shape) != header["shape"]:
        raise KvIntegrityError(
            f"tensor {tensor.dtype} {list(tensor.shape)} does not match header "
            f"{header['dtype']} {header['shape']}", header
        )
    crc = crc32c(tensor)
    if crc != header["checksum"]:
        raise KvIntegrityError(
            f"checksum mismatch: header {header['checksum']:#010x}, tensor {crc:#010x}", header
        )


def encode_done_chunk(
    request_id: str,
    transfer_id: str,
    generation: int,
    num_chunks: int,
    num_layers: int,
    first_token_id: int,
    first_token_logprobs: dict[Any, Any] | None,
) -> KvFrame:
    """Build the final ``"done"`` chunk of a transfer (empty payload).

    Args:
        num_chunks: number of ``"kv"`` chunks sent before this one.
        num_layers: layers covered by the whole transfer.
        first_token_id: token sampled by the prefill worker.
        first_token_logprobs: its logprob data (msgpack-able dict) or ``None``.

    Raises:
        TypeError: ``first_token_logprobs`` is not msgpack-able.
    """
    header = {
        "v": WIRE_VERSION,
        "kind": KIND_DONE,
        "request_id": request_id,
        "transfer_id": transfer_id,
        "generation": int(generation),
        "num_chunks": int(num_chunks),
        "num_layers": int(num_layers),
        "first_token_id": int(first_token_id),
        "first_token_logprobs": first_token_logprobs,
        "checksum": crc32c(b""),
    }
    return KvFrame(msgpack.packb(header))


def _is_int(x: Any, minimum: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= minimum


def _require(header: dict[str, Any], ok: bool, what: str) -> None:
    if not ok:
        raise KvIntegrityError(f"bad header field: {what}", header)


def _parse_header(raw: bytes) -> dict[str, Any]:
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:  # msgpack's errors on garbage
        raise KvIntegrityError(f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise KvIntegrityError(f"header is a {type(header).__name__}, not a map")
    h = header
    v = h.get("v")
    _require(h, _is_int(v) and v == WIRE_VERSION, f"v={v!r}: this receiver speaks KV wire version {WIRE_VERSION}")
    _require(h, h.get("kind") in (KIND_KV, KIND_DONE), f"kind={h.get('kind')!r}")
    for key in ("request_id", "transfer_id"):
        _require(h, isinstance(h.get(key), str), key)
    _require(h, _is_int(h.get("generation")), "generation")
    _require(h, _is_int(h.get("checksum")), "checksum")
    return header


def _check_kv_header(h: dict[str, Any]) -> torch.dtype:
    ls, le = h.get("layer_start"), h.get("layer_end")
    _require(h, _is_int(ls) and _is_int(le) and le > ls, "layer_start/layer_end")
    ids = h.get("block_ids")
    _require(h, isinstance(ids, list) and ids and all(_is_int(b) for b in ids), "block_ids")
    _require(h, len(set(ids)) == len(ids), "block_ids (duplicates)")
    bs = h.get("block_size")
    _require(h, _is_int(bs, 1), "block_size")
    ts = h.get("token_start")
    _require(h, _is_int(ts) and ts % bs == 0, "token_start (a multiple of block_size)")
    try:
        dtype = dtype_from_name(h.get("dtype"))
    except ValueError as exc:
        raise KvIntegrityError(str(exc), h) from None
    shape = h.get("shape")
    _require(h, isinstance(shape, list) and len(shape) == 6 and all(_is_int(n, 1) for n in shape), "shape")
    _require(h, shape[:2] == [le - ls, 2] and shape[3] == bs,
             f"shape {shape} does not match [{le - ls}, 2, n, {bs}, heads, head_dim]")
    return dtype


def _check_dist(h: dict[str, Any]) -> None:
    d = h.get("dist")
    _require(h, isinstance(d, dict), "dist")
    _require(h, isinstance(d.get("pair"), str) and d["pair"] != "", "dist.pair")
    store = d.get("store")
    _require(h, isinstance(store, str) and store.rpartition(":")[2].isdigit(), "dist.store")
    _require(h, d.get("backend") in DIST_BACKENDS, "dist.backend")
    _require(h, _is_int(d.get("tag")), "dist.tag")
    t = d.get("timeout_s")
    _require(h, isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0, "dist.timeout_s")


def decode_chunk(chunk: KvFrame | kv_pb2.KvChunk, *, copy: bool = True) -> tuple[dict[str, Any], torch.Tensor | None]:
    """Parse and verify one chunk (a received :class:`KvFrame`, or a ``KvChunk`` message).

    Args:
        copy: True: a ``"kv"`` chunk's tensor is a new, writable CPU tensor. False: a
            read-only view of the payload (no copy; :func:`tensor_from_payload`), as the
            receiver hands its sink.

    Returns:
        ``(header, tensor)``: for ``"kv"`` chunks ``tensor`` is a CPU tensor
        of ``header["shape"]`` and ``header["dtype"]``; for ``"done"`` chunks and
        for ``"kv"`` chunks with ``"data": "dist"`` (whose tensor the caller
        receives elsewhere and checks with :func:`verify_tensor`) it is ``None``.

    Raises:
        KvIntegrityError: a message that is no ``KvChunk``, an unparsable or
            inconsistent header, another wire version, unknown dtype, payload size
            not matching shape and dtype, non-empty ``"done"`` payload, or CRC32C
            mismatch. ``exc.header`` holds the header when it parsed.
    """
    if getattr(chunk, "error", None):
        raise KvIntegrityError(chunk.error)
    header = _parse_header(chunk.header)
    payload = chunk.payload  # read once: protobuf copies a bytes field out on every read
    size = payload.nbytes if isinstance(payload, memoryview) else len(payload)
    if header["kind"] == KIND_DONE:
        _require(header, _is_int(header.get("num_chunks")), "num_chunks")
        _require(header, _is_int(header.get("num_layers"), 1), "num_layers")
        _require(header, _is_int(header.get("first_token_id")), "first_token_id")
        lp = header.get("first_token_logprobs")
        _require(header, lp is None or isinstance(lp, dict), "first_token_logprobs")
        if size:
            raise KvIntegrityError(f"done chunk carries a {size}-byte payload", header)
        return header, None
    dtype = _check_kv_header(header)
    if "data" in header:
        _require(header, header["data"] == DATA_DIST, f"data={header['data']!r}")
        _check_dist(header)
        if size:
            raise KvIntegrityError(f"dist chunk carries a {size}-byte payload", header)
        return header, None
    want = nbytes_of(dtype, header["shape"])
    if want != size:
        raise KvIntegrityError(f"payload is {size} bytes, shape {header['shape']} of {dtype} needs {want}", header)
    crc = crc32c(payload)
    if crc != header["checksum"]:
        raise KvIntegrityError(f"checksum mismatch: header {header['checksum']:#010x}, payload {crc:#010x}", header)
    return header, tensor_from_payload(payload, dtype, header["shape"], copy=copy)
