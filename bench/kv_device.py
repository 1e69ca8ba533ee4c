"""KV transport bandwidth between two processes with the caches on a device (``scripts/gpu_check.sh``).

A sender (this process) holds a paged KV cache ``[layers, 2, blocks, block_size, kv_heads,
head_dim]`` filled with random values; a receiver process (``bench/_kv_receiver.py``) holds
a zeroed cache of the same shape and serves the ``torch_dist`` transport's receiver (it takes
``grpc`` senders too) and a raw TCP socket on 127.0.0.1. Per prompt length, each transport
pushes that many tokens' blocks ``--reps`` times after one warm-up (``bench/_kv_measure.py``'s
``GrpcPath``: reservation opened before the clock, timed from ``send`` to the acknowledgement);
GB/s = payload bytes / median seconds. The warm-up transfer's blocks are checked on the receiver
(CRC32 of every layer's bytes).

* ``--device cuda``: Llama-3-8B's KV shape (32 layers, 8 KV heads, head_dim 128), bfloat16,
  block 16; the sender's cache on ``cuda:0``, the receiver's on ``cuda:1`` where there are two
  GPUs, else on ``cuda:0`` too. ``torch_dist`` moves tensors with NCCL, which refuses two
  ranks on one GPU ("Duplicate GPU detected", NVIDIA/nccl#418): with one GPU it is reported
  skipped with that reason. ``grpc`` (device -> host -> gRPC -> host -> device) runs either way.
* ``--device cpu``: SmolLM2-135M's KV shape (30 layers, 3 KV heads, head_dim 64), float32;
  ``torch_dist`` over gloo.
* ``raw_tcp``: the same bytes from host memory over loopback TCP, for reference.

Writes one JSON object to ``--out`` (and stdout): ``{"device", "dtype", "shape", "results":
[{"tokens", "payload_bytes", "raw_tcp": {...}, "grpc": {...}, "torch_dist": {...} | null}],
"torch_dist_backend", "torch_dist_skipped": reason | null}`` with ``gb_per_s``,
``latency_ms`` and ``verified`` per transport, ``ratio_raw_tcp`` for the two transports.

Usage: ``python bench/kv_device.py --device cuda --out kv.json``;
``python bench/kv_device.py --device cpu --tokens 256 --reps 2 --out kv.json`` (CI-sized).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package `kvtransfer`, not bench/kvtransfer.py

import _kv_measure as km  # noqa: E402
import torch  # noqa: E402

from kvtransfer import DEFAULT_MAX_CHUNK_BYTES, gather_blocks  # noqa: E402

SHAPES = {  # (layers, kv_heads, head_dim, dtype)
    "cuda": (32, 8, 128, "bfloat16"),  # Llama-3-8B
    "cpu": (30, 3, 64, "float32"),  # SmolLM2-135M
}
BLOCK_SIZE = 16
LAYERS_PER_CHUNK = 4


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=sorted(SHAPES), required=True)
    p.add_argument("--tokens", default=None,
                   help="comma-separated prompt lengths (default 1024,8192 on cuda, 256 on cpu)")
    p.add_argument("--reps", type=int, default=5, help="timed transfers per transport and length")
    p.add_argument("--out", type=Path, required=True, help="JSON output file")
    a = p.parse_args(argv)
    a.tokens = [int(x) for x in (a.tokens or ("1024,8192" if a.device == "cuda" else "256")).split(",")]
    if a.reps < 1 or min(a.tokens) < BLOCK_SIZE:
        p.error(f"--reps must be >= 1 and every --tokens >= {BLOCK_SIZE}")
    return a


def devices(kind: str) -> tuple[str, str, str, str | None]:
    """``(sender device, receiver device, torch_dist backend, reason torch_dist is skipped or None)``."""
    import torch.distributed as dist

    if kind == "cpu":
        return "cpu", "cpu", "gloo", None if dist.is_gloo_available() else "torch.distributed has no gloo"
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible to torch")
    if not dist.is_nccl_available():
        return "cuda:0", "cuda:0", "nccl", "torch.distributed has no NCCL in this build"
    if torch.cuda.device_count() < 2:
        return "cuda:0", "cuda:0", "nccl", ("one GPU: NCCL refuses two ranks on one GPU ('Duplicate GPU detected', "
                                            "NVIDIA/nccl#418); torch_dist needs the receiver on a second GPU")
    return "cuda:0", "cuda:1", "nccl", None


def _one(path: km.GrpcPath, receiver: km.Receiver, reps: int, expect_crc: int, nbytes: int) -> dict:
    """Warm-up transfer (checked), then ``reps`` timed ones: :func:`_kv_measure._stats` + ``verified``."""
    path.once()
    verified = receiver.call(cmd="digest", block_ids=path.last_block_ids)["crc32"] == expect_crc
    times = [path.once() for _ in range(reps)]
    return km._stats(times, nbytes) | {"verified": verified, "num_chunks": path.num_chunks}


def _raw_tcp(receiver: km.Receiver, view: memoryview, reps: int) -> dict:
    receiver.call(cmd="raw_buffer", nbytes=len(view))
    with socket.create_connection(("127.0.0.1", receiver.tcp_port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        km.raw_tcp_once(sock, view)
        return km._stats([km.raw_tcp_once(sock, view) for _ in range(reps)], len(view))


def measure(kv_cache: torch.Tensor, receiver: km.Receiver, tokens: int, reps: int, dist_ok: bool) -> dict:
    """Every transport for ``tokens`` tokens' blocks (blocks 1.. of the sender's cache)."""
    src_ids = list(range(1, -(-tokens // BLOCK_SIZE) + 1))
    blocks = gather_blocks(kv_cache, 0, kv_cache.shape[0], src_ids)
    view = km.payload_view(blocks)
    nbytes, crc = len(view), zlib.crc32(view)
    res = {"tokens": tokens, "payload_bytes": nbytes, "raw_tcp": _raw_tcp(receiver, view, reps)}
    for name in ("grpc", "torch_dist"):
        if name == "torch_dist" and not dist_ok:
            res[name] = None
            continue
        path = km.GrpcPath(receiver, kv_cache, src_ids, LAYERS_PER_CHUNK, DEFAULT_MAX_CHUNK_BYTES, transport=name)
        try:
            res[name] = _one(path, receiver, reps, crc, nbytes)
        finally:
            path.close()
        res[name]["ratio_raw_tcp"] = res[name]["gb_per_s"] / res["raw_tcp"]["gb_per_s"]
    return res


def main(argv=None) -> int:
    a = _parse(argv)
    send_dev, recv_dev, backend, dist_skip = devices(a.device)
    layers, kv_heads, head_dim, dtype = SHAPES[a.device]
    num_blocks = -(-max(a.tokens) // BLOCK_SIZE) + 2
    shape = (layers, 2, num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    g = torch.Generator(device=send_dev).manual_seed(0)
    kv_cache = torch.randn(*shape, generator=g, device=send_dev, dtype=getattr(torch, dtype))
    with km.Receiver(shape, DEFAULT_MAX_CHUNK_BYTES, device=recv_dev, dtype=dtype) as receiver:
        results = [measure(kv_cache, receiver, t, a.reps, dist_skip is None) for t in a.tokens]
    out = {"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu", "sender_device": send_dev,
           "receiver_device": recv_dev, "dtype": dtype, "shape": list(shape), "reps": a.reps,
           "torch_dist_backend": backend, "torch_dist_skipped": dist_skip, "results": results}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
