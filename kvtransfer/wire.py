"""Wire format of one KV chunk: a msgpack header plus the raw bytes of a tensor.

A transfer is a stream of ``"kv"`` chunks followed by one ``"done"`` chunk,
each a :class:`pdcluster.v1.kv_pb2.KvChunk` (``header``, ``payload``).

``"kv"`` header keys: ``kind``, ``request_id``, ``transfer_id``, ``generation``,
``layer_start``, ``layer_end`` (layers ``[start, end)``), ``block_ids``
(destination block ids, one per payload block), ``block_size`` (tokens per
block, the sender's: the seam for re-blocking), ``dtype`` (torch dtype name,
e.g. ``"bfloat16"``), ``shape`` (payload tensor shape) and ``checksum``.
The payload is the C-order bytes of a
``[layer_end - layer_start, 2, len(block_ids), block_size, num_kv_heads, head_dim]``
tensor, native (little-endian) byte order.

``"done"`` header keys: ``kind``, ``request_id``, ``transfer_id``,
``generation``, ``num_chunks`` (``"kv"`` chunks sent before it),
``num_layers`` (layers of the whole transfer, for the coverage check),
``first_token_id``, ``first_token_logprobs`` (msgpack-able dict or ``None``)
and ``checksum``; its payload is empty.

``checksum`` is the CRC32 (:func:`zlib.crc32`) of the payload bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
import zlib

import msgpack
import torch

from kvtransfer.errors import KvIntegrityError
from pdcluster.v1 import kv_pb2

KIND_KV = "kv"
KIND_DONE = "done"

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
        block_ids: destination block ids, one per payload block (dim 2).
        block_size: tokens per block of the payload.
    """

    request_id: str
    transfer_id: str
    generation: int
    layer_start: int
    layer_end: int
    block_ids: Sequence[int]
    block_size: int


def tensor_to_bytes(tensor: torch.Tensor) -> bytes:
    """Raw C-order bytes of ``tensor`` (any dtype, bf16 included, any device).

    Goes through a ``uint8`` view, so the only copies are to CPU (when on an
    accelerator), to contiguous (when strided) and into the ``bytes`` object.
    """
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    numel = 1
    for n in shape:
        numel *= n
    return numel * dtype.itemsize


def tensor_from_bytes(payload: bytes, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """Rebuild a CPU tensor from :func:`tensor_to_bytes` output (one copy, writable result).

    Raises:
        KvIntegrityError: ``len(payload)`` does not match ``shape`` and ``dtype``.
    """
    want = _nbytes(dtype, shape)
    if want != len(payload):
        raise KvIntegrityError(
            f"payload is {len(payload)} bytes, shape {list(shape)} of {dtype} needs {want}"
        )
    if want == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return flat.view(dtype).reshape(tuple(shape))


def encode_kv_chunk(meta: KvChunkMeta, tensor: torch.Tensor) -> kv_pb2.KvChunk:
    """Build a ``"kv"`` chunk carrying ``tensor`` for ``meta``'s layers and blocks.

    Args:
        meta: addressing of the chunk.
        tensor: ``[layer_end - layer_start, 2, len(block_ids), block_size,
            num_kv_heads, head_dim]``, floating dtype, any device/strides.

    Returns:
        The chunk; ``len(chunk.payload) == tensor.numel() * tensor.element_size()``.

    Raises:
        ValueError: ``tensor`` shape disagrees with ``meta``, or its dtype is
            not floating point, or ``meta`` has an empty or inverted range.
    """
    want = (meta.layer_end - meta.layer_start, 2, len(meta.block_ids), meta.block_size)
    if tensor.dim() != 6 or tuple(tensor.shape[:4]) != want or min(tensor.shape) < 1:
        raise ValueError(
            f"tensor shape {tuple(tensor.shape)} does not match {want} + (num_kv_heads, head_dim)"
        )
    payload = tensor_to_bytes(tensor)
    header = {
        "kind": KIND_KV,
        "request_id": meta.request_id,
        "transfer_id": meta.transfer_id,
        "generation": int(meta.generation),
        "layer_start": int(meta.layer_start),
        "layer_end": int(meta.layer_end),
        "block_ids": [int(b) for b in meta.block_ids],
        "block_size": int(meta.block_size),
        "dtype": dtype_name(tensor.dtype),
        "shape": [int(n) for n in tensor.shape],
        "checksum": zlib.crc32(payload),
    }
    return kv_pb2.KvChunk(header=msgpack.packb(header), payload=payload)


def encode_done_chunk(
    request_id: str,
    transfer_id: str,
    generation: int,
    num_chunks: int,
    num_layers: int,
    first_token_id: int,
    first_token_logprobs: dict[Any, Any] | None,
) -> kv_pb2.KvChunk:
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
        "kind": KIND_DONE,
        "request_id": request_id,
        "transfer_id": transfer_id,
        "generation": int(generation),
        "num_chunks": int(num_chunks),
        "num_layers": int(num_layers),
        "first_token_id": int(first_token_id),
        "first_token_logprobs": first_token_logprobs,
        "checksum": zlib.crc32(b""),
    }
    return kv_pb2.KvChunk(header=msgpack.packb(header), payload=b"")


def _is_int(x: Any, minimum: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= minimum


def _require(header: dict[str, Any], ok: bool, what: str) -> None:
    if not ok:
        raise KvIntegrityError(f"bad header field: {what}", header)


def _parse_header(raw: bytes) -> dict[str, Any]:
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise KvIntegrityError(f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise KvIntegrityError(f"header is a {type(header).__name__}, not a map")
    h = header
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
    _require(h, _is_int(h.get("block_size"), 1), "block_size")
    try:
        dtype = dtype_from_name(h.get("dtype"))
    except ValueError as exc:
        raise KvIntegrityError(str(exc), h) from None
    shape = h.get("shape")
    _require(h, isinstance(shape, list) and len(shape) == 6 and all(_is_int(n, 1) for n in shape), "shape")
    want = [le - ls, 2, len(ids), h["block_size"]]
    _require(h, shape[:4] == want, f"shape {shape} does not start with {want}")
    return dtype


def decode_chunk(chunk: kv_pb2.KvChunk) -> tuple[dict[str, Any], torch.Tensor | None]:
    """Parse and verify one chunk.

    Returns:
        ``(header, tensor)``: for ``"kv"`` chunks ``tensor`` is a new CPU tensor
        of ``header["shape"]`` and ``header["dtype"]``; for ``"done"`` it is ``None``.

    Raises:
        KvIntegrityError: unparsable or inconsistent header, unknown dtype,
            payload size not matching shape and dtype, non-empty ``"done"``
            payload, or CRC32 mismatch. ``exc.header`` holds the header when it
            parsed.
    """
    header = _parse_header(chunk.header)
    payload = chunk.payload
    if header["kind"] == KIND_DONE:
        _require(header, _is_int(header.get("num_chunks")), "num_chunks")
        _require(header, _is_int(header.get("num_layers"), 1), "num_layers")
        _require(header, _is_int(header.get("first_token_id")), "first_token_id")
        lp = header.get("first_token_logprobs")
        _require(header, lp is None or isinstance(lp, dict), "first_token_logprobs")
        if payload:
            raise KvIntegrityError(f"done chunk carries a {len(payload)}-byte payload", header)
        return header, None
    dtype = _check_kv_header(header)
    want = _nbytes(dtype, header["shape"])
    if want != len(payload):
        raise KvIntegrityError(
            f"payload is {len(payload)} bytes, shape {header['shape']} of {dtype} needs {want}", header
        )
    crc = zlib.crc32(payload)
    if crc != header["checksum"]:
        raise KvIntegrityError(
            f"checksum mismatch: header {header['checksum']:#010x}, payload {crc:#010x}", header
        )
    return header, tensor_from_bytes(payload, dtype, header["shape"])
