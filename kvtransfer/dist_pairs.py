"""torch.distributed pair groups: 2-rank process groups that carry KV tensors point to point.

Built without ``init_process_group`` (like vLLM's stateless process groups): a
:class:`torch.distributed.TCPStore` hosted by the sender (rank 0) and one
``ProcessGroupGloo`` (CPU tensors) or ``ProcessGroupNCCL`` (CUDA tensors) per
(sender, receiver endpoint) pair, keyed in the store by a fresh pair id. The
receiver joins as rank 1 when it first sees the pair id in a chunk header.

A pair carries one transfer at a time, tags each tensor with a per-pair
counter, and is dropped on both sides after any failure of a transfer that
used it (dropping closes its connections, which also ends an operation the
peer is blocked in); the next transfer then builds a new pair with a new id.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import socket
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kvtransfer.errors import KvDataPlaneError
from kvtransfer.wire import dtype_from_name, verify_tensor

_TAG_LIMIT = 1 << 30


def local_ip_towards(host: str) -> str:
    """Address of this host on the route to ``host`` (no packet is sent); ``127.0.0.1`` when unknown."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def backend_for(device: torch.device) -> str:
    """``"nccl"`` for CUDA tensors, ``"gloo"`` otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def _make_group(backend: str, store: dist.Store, pair_id: str, rank: int, timeout_s: float, hostname: str):
    """Create this side of a pair group; blocks until both ranks joined (or the timeout)."""
    prefix = dist.PrefixStore(f"kvpair/{pair_id}/", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
            return dist.ProcessGroupGloo(prefix, rank, 2, opts)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefix, rank, 2, opts)
    except RuntimeError as exc:  # DistStoreError, DistNetworkError and gloo errors are RuntimeErrors
        raise KvDataPlaneError(f"pair {pair_id} rank {rank}: group not formed: {exc}") from None


def _wait(work: Any, backend: str, timeout_s: float, what: str) -> None:
    """Wait for a point-to-point operation, at most ``timeout_s`` (host-side for both backends)."""
    try:
        if backend == "gloo":
            work.wait(datetime.timedelta(seconds=max(timeout_s, 0.001)))
            return
        deadline = time.monotonic() + timeout_s
        pause = 1e-4
        while not work.is_completed():
            if time.monotonic() >= deadline:
                raise KvDataPlaneError(f"{what} timed out after {timeout_s:.3g}s")
            time.sleep(pause)
            pause = min(pause * 2, 5e-3)
        if not work.is_success():
            work.wait()  # raises the operation's error
    except KvDataPlaneError:
        raise
    except RuntimeError as exc:
        raise KvDataPlaneError(f"{what} failed: {exc}") from None


class SenderPair:
    """Rank 0 of one pair group: created in a thread so its first header can go out meanwhile."""

    def __init__(self, endpoint: str, backend: str, store: dist.TCPStore, store_host: str, timeout_s: float) -> None:
        self.pair_id = uuid.uuid4().hex
        self.endpoint = endpoint
        self.backend = backend
        self.timeout_s = timeout_s
        self.store_address = f"{store_host}:{store.port}"
        self._tag = 0
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        threading.Thread(
            target=self._create, args=(store, store_host), daemon=True, name=f"kvpair-{self.pair_id[:8]}"
        ).start()

    def _create(self, store: dist.TCPStore, hostname: str) -> None:
        try:
            self._future.set_result(_make_group(self.backend, store, self.pair_id, 0, self.timeout_s, hostname))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting sender
            self._future.set_exception(exc)

    def header_fields(self, tag: int) -> dict[str, Any]:
        """The ``"dist"`` map of a chunk header whose tensor goes with ``tag``."""
        return {"pair": self.pair_id, "store": self.store_address, "backend": self.backend,
                "tag": tag, "timeout_s": float(self.timeout_s)}

    def next_tag(self) -> int:
        """A new tag for the next tensor on this pair."""
        self._tag = (self._tag + 1) % _TAG_LIMIT
        return self._tag

    def start_send(self, tensor: torch.Tensor, tag: int, deadline: float, stopped) -> Any:
        """Start sending ``tensor`` to rank 1 (the group formed by ``deadline``, monotonic seconds) and
        return its pending work for :meth:`wait_sent`; ``tensor`` must stay alive and unchanged until then.

        ``stopped()`` is polled while the group is still forming.

        Raises:
            KvDataPlaneError: the group did not form, the send failed to start, or the deadline passed.
        """
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or stopped():
                raise KvDataPlaneError(f"pair {self.pair_id}: receiver did not join in time")
            try:
                group = self._future.result(timeout=min(left, 0.05))
                break
            except concurrent.futures.TimeoutError:
                continue
        try:
            return group.send([tensor], 1, tag)
        except RuntimeError as exc:
            raise KvDataPlaneError(f"pair {self.pair_id}: send failed: {exc}") from None

    def wait_sent(self, work: Any, tag: int, deadline: float) -> None:
        """Wait until the send :meth:`start_send` started for ``tag`` left, by ``deadline``.

        Raises:
            KvDataPlaneError: the send failed or the deadline passed.
        """
        _wait(work, self.backend, deadline - time.monotonic(), f"pair {self.pair_id}: send of tag {tag}")


class SenderPairs:
    """A sender's pair groups, at most ``max_per_endpoint`` per receiver endpoint, each used by one transfer at a time.

    The TCPStore (rank 0's rendezvous) is created on first use on a free port
    and shared by all pairs (each under its own key prefix).
    """

    def __init__(self, max_per_endpoint: int = 4) -> None:
        if max_per_endpoint < 1:
            raise ValueError(f"max_per_endpoint must be >= 1, got {max_per_endpoint}")
        self._max = max_per_endpoint
        self._cond = threading.Condition()
        self._store: dist.TCPStore | None = None
        self._idle: dict[str, list[SenderPair]] = {}
        self._count: dict[str, int] = {}
        self._closed = False

    def acquire(self, endpoint: str, backend: str, timeout_s: float, deadline: float) -> SenderPair:
        """An idle pair to ``endpoint`` with ``backend``, or a new one, waiting for a free one until ``deadline``.

        Raises:
            KvDataPlaneError: closed, or no pair free before ``deadline``, or the store could not start.
        """
        host = endpoint.rpartition(":")[0].strip("[]") or "127.0.0.1"
        with self._cond:
            while True:
                if self._closed:
                    raise KvDataPlaneError("sender pairs are closed")
                idle = [p for p in self._idle.get(endpoint, []) if p.backend == backend and p.timeout_s == timeout_s]
                if idle:
                    self._idle[endpoint].remove(idle[0])
                    return idle[0]
                if self._idle.get(endpoint):  # idle but other settings: replace one
                    self._idle[endpoint].pop()
                    self._count[endpoint] -= 1
                if self._count.get(endpoint, 0) < self._max:
                    self._count[endpoint] = self._count.get(endpoint, 0) + 1
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KvDataPlaneError(f"all {self._max} pair groups to {endpoint} stayed busy")
                self._cond.wait(left)
        try:
            return SenderPair(endpoint, backend, self._get_store(timeout_s), local_ip_towards(host), timeout_s)
        except BaseException:
            self.release(None, endpoint, ok=False)
            raise

    def release(self, pair: SenderPair | None, endpoint: str, ok: bool) -> None:
        """Return ``pair`` for reuse (``ok``) or drop it (any failure of its transfer)."""
        with self._cond:
            if ok and pair is not None and not self._closed:
                self._idle.setdefault(endpoint, []).append(pair)
            else:
                self._count[endpoint] = max(0, self._count.get(endpoint, 0) - 1)
            self._cond.notify_all()

    def close(self) -> None:
        """Drop every idle pair; later :meth:`acquire` calls raise."""
        with self._cond:
            self._closed = True
            self._idle.clear()
            self._cond.notify_all()

    def _get_store(self, timeout_s: float) -> dist.TCPStore:
        with self._cond:
            if self._store is None:
                try:
                    self._store = dist.TCPStore("0.0.0.0", 0, None, True,
                                                timeout=datetime.timedelta(seconds=max(timeout_s, 1.0)),
                                                wait_for_workers=False)
                except RuntimeError as exc:
                    raise KvDataPlaneError(f"TCPStore could not start: {exc}") from None
            return self._store


class _ReceiverPair:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.group: Any = None
        self.backend = "gloo"


@dataclass(frozen=True, slots=True)
class PostedRecv:
    """A receive :meth:`ReceiverPairs.post` started: the tensor it fills and its pending work."""

    buf: torch.Tensor
    work: Any
    backend: str


class ReceiverPairs:
    """A receiver's pair groups (rank 1), joined on first sight of a pair id; at most ``max_pairs`` kept.

    Thread-safe; streams of different pairs receive concurrently.
    """

    def __init__(self, max_pairs: int = 256) -> None:
        self._max = max_pairs
        self._lock = threading.Lock()
        self._pairs: OrderedDict[str, _ReceiverPair] = OrderedDict()

    def receive(self, header: dict[str, Any], posted: "PostedRecv | None" = None) -> torch.Tensor:
        """Receive the tensor a decoded ``"data": "dist"`` header announces, and verify it.

        Args:
            posted: the receive :meth:`post` started for this header, if any (else it starts now).

        Returns:
            The tensor, of the header's shape and dtype: on CPU (gloo) or the
            current CUDA device (nccl).

        Raises:
            KvDataPlaneError: joining the pair or receiving failed or timed out.
            KvIntegrityError: shape, dtype or CRC32C differ from the header.
        """
        posted = posted if posted is not None else self.post(header)
        d = header["dist"]
        _wait(posted.work, posted.backend, d["timeout_s"], f"pair {d['pair']}: recv of tag {d['tag']}")
        verify_tensor(header, posted.buf)
        return posted.buf

    def post(self, header: dict[str, Any]) -> "PostedRecv":
        """Start receiving the tensor a decoded ``"data": "dist"`` header announces (joining its pair
        group on first sight), without waiting for it: several receives of one pair may be posted.

        Raises:
            KvDataPlaneError: joining the pair or posting the receive failed.
        """
        d = header["dist"]
        pair = self._get(d["pair"])
        with pair.lock:
            if pair.group is None:
                pair.backend = d["backend"]
                host, _, port = d["store"].rpartition(":")
                host = host.strip("[]")
                try:
                    store = dist.TCPStore(host, int(port), None, False,
                                          timeout=datetime.timedelta(seconds=d["timeout_s"]))
                except RuntimeError as exc:
                    self.drop(d["pair"])
                    raise KvDataPlaneError(f"cannot reach the sender's store {d['store']}: {exc}") from None
                pair.group = _make_group(pair.backend, store, d["pair"], 1, d["timeout_s"], local_ip_towards(host))
            device = torch.device("cuda", torch.cuda.current_device()) if pair.backend == "nccl" else "cpu"
            buf = torch.empty(header["shape"], dtype=dtype_from_name(header["dtype"]), device=device)
            try:
                return PostedRecv(buf, pair.group.recv([buf], 0, d["tag"]), pair.backend)
            except RuntimeError as exc:
                raise KvDataPlaneError(f"pair {d['pair']}: recv failed: {exc}") from None

    def drop(self, pair_id: str) -> None:
        """Forget a pair (closing its connections once unreferenced); unknown ids are ignored."""
        with self._lock:
            self._pairs.pop(pair_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pairs)

    def _get(self, pair_id: str) -> _ReceiverPair:
        with self._lock:
            pair = self._pairs.get(pair_id)
            if pair is None:
                pair = self._pairs[pair_id] = _ReceiverPair()
                while len(self._pairs) > self._max:
                    self._pairs.popitem(last=False)
            self._pairs.move_to_end(pair_id)
            return pair
