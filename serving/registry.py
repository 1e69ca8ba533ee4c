"""Worker registry on Redis: who is alive, where it listens, how loaded it is.

Key layout, under the namespace ``pdcluster:<cluster>:``:

* ``workers`` - set of registered worker ids.
* ``worker:<id>:info`` - hash of :class:`WorkerInfo` fields (TTL'd).
* ``worker:<id>:hb`` - liveness key holding the :class:`WorkerLoadSnapshot`
  as JSON (TTL'd); a worker is live exactly while this key exists.
* ``worker:<id>:generation`` - counter of the processes that registered as ``<id>``.
* ``state:<key>`` - small JSON documents (:meth:`WorkerRegistry.put_state`): the router's
  ports, the cluster's desired state and its controller's report.
* ``router:<index>`` - one :class:`RouterRecord` per live router process, as JSON (TTL'd:
  a router is live exactly while its record exists; :meth:`WorkerRegistry.put_router`).

Workers keep themselves registered with a :class:`serving.heartbeat.Heartbeater`;
the router reads the live set through a :class:`serving.discovery.RegistryView`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, fields

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from serving.typed_json import typed_fields

log = logging.getLogger(__name__)

WORKER_ROLES = ("prefill", "decode", "colocated")
"""The roles of worker processes (a router registers as ``router``)."""
ROLES = (*WORKER_ROLES, "router")

# Drop a set member whose info and liveness keys both vanished (atomic, so a
# worker registering concurrently is never dropped).
_PRUNE_LUA = """
if redis.call('EXISTS', KEYS[2]) == 0 and redis.call('EXISTS', KEYS[3]) == 0 then
  return redis.call('SREM', KEYS[1], ARGV[1])
end
return 0
"""

CONTROLLER_REPORT_KEY = "controller"
"""``state:`` key of the cluster controller's report (:mod:`deploy.controller`): desired workers
by role, each desired worker's liveness, why it is missing and how often it was restarted."""


@dataclass(frozen=True)
class WorkerInfo:
    """Static description of one registered process.

    Attributes:
        worker_id: unique id within the cluster.
        role: ``"prefill"``, ``"decode"`` or ``"router"``.
        address: ``host:port`` of its gRPC server.
        kv_endpoint: ``host:port`` of its KvTransfer service (decode only, else ``""``).
        node_id: machine / Ray node it runs on.
        model: model name it serves.
        block_size: tokens per KV block.
        num_total_blocks: KV blocks in its pool.
        started_at: start time, unix seconds.
        metrics_address: ``host:port`` serving its Prometheus ``/metrics`` (``""``: none).
        generation: how many times a process registered under this ``worker_id`` (1 for the
            first; a replacement after a crash registers under the next, from
            :meth:`WorkerRegistry.next_generation`).
        pid: the process id on its node (what ``pdcluster status`` shows and chaos tests kill).
        max_num_seqs: requests it runs at once (decode and colocated workers: its batch
            size; 0: not published). The router's admission counts these seats.
    """

    worker_id: str
    role: str
    address: str
    kv_endpoint: str = ""
    node_id: str = ""
    model: str = ""
    block_size: int = 0
    num_total_blocks: int = 0
    started_at: float = 0.0
    metrics_address: str = ""
    generation: int = 0
    pid: int = 0
    max_num_seqs: int = 0

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("worker_id must be non-empty")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")

    def to_hash(self) -> dict[str, str]:
        """Field values as strings, for a Redis hash."""
        return {k: str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_hash(cls, h: dict[str, str]) -> "WorkerInfo":
        """Inverse of :meth:`to_hash`.

        Raises:
            KeyError: a required field is missing.
            ValueError: a numeric field does not parse.
        """
        kwargs: dict[str, object] = {}
        for f in fields(cls):
            if f.name not in h:
                continue
            raw = h[f.name]
            kwargs[f.name] = int(raw) if f.type == "int" else float(raw) if f.type == "float" else raw
        return cls(**kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class WorkerLoadSnapshot:
    """Load reported with each heartbeat.

    Attributes:
        num_waiting: requests held, not in the batch (a decode worker's: waiting for blocks,
            for their KV or a seat, or preempted).
        num_running: requests in the batch.
        num_free_blocks: free KV blocks.
        num_total_blocks: KV blocks in the pool.
        draining: the worker accepts no new requests.
        updated_at: when the snapshot was taken, unix seconds (worker clock).
    """

    num_waiting: int = 0
    num_running: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    draining: bool = False
    updated_at: float = 0.0

    def to_json(self) -> str:
        """JSON text of the snapshot."""
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "WorkerLoadSnapshot":
        """Inverse of :meth:`to_json`; unknown keys are ignored.

        Raises:
            ValueError: ``text`` is not a JSON object.
            TypeError: a field's value is not of its declared type.
        """
        return cls(**typed_fields(cls, text))


@dataclass(frozen=True)
class RouterRecord:
    """One live router process (``pdcluster up --routers N`` runs N behind one address).

    Attributes:
        index: the router's index in the cluster (0 .. N-1); its id is ``router-<index>``.
        pid: its process id on its node.
        address: ``host:port`` of the gRPC port it shares with the cluster's other routers.
        metrics_address: ``host:port`` of its own ``/metrics`` (not shared).
        node_id: the machine / Ray node it runs on.
        started_at: when it started serving, unix seconds.
    """

    index: int
    pid: int
    address: str
    metrics_address: str
    node_id: str = ""
    started_at: float = 0.0

    @property
    def router_id(self) -> str:
        return f"router-{self.index}"

    @classmethod
    def from_json(cls, text: str) -> "RouterRecord":
        """The record stored as JSON text (unknown keys ignored). Raises ValueError (not a JSON
        object) or TypeError (a field missing or of the wrong type: a bad record in Redis must not
        break the routers that list them all)."""
        return cls(**typed_fields(cls, text))


class WorkerRegistry:
    """Registry operations on one Redis for one cluster namespace.

    Every method talks to Redis directly and raises
    ``redis.exceptions.ConnectionError`` / ``redis.exceptions.TimeoutError``
    within about ``socket_timeout_s`` (x2: one reconnect attempt) when Redis is
    unreachable; none blocks indefinitely.

    Args:
        redis_url: ``redis://host:port/db``.
        cluster: namespace; several clusters may share one Redis.
        socket_timeout_s: connect and read timeout of each Redis call (seconds).

    Raises:
        ValueError: empty cluster name or one containing ``:``.
    """

    def __init__(self, redis_url: str, cluster: str = "default", socket_timeout_s: float = 2.0) -> None:
        if not cluster or ":" in cluster:
            raise ValueError(f"cluster name must be non-empty and contain no ':', got {cluster!r}")
        self.redis_url = redis_url
        self.cluster = cluster
        self.prefix = f"pdcluster:{cluster}:"
        # One retry lets a pooled connection broken by a Redis restart reconnect;
        # no backoff, so a dead Redis fails fast.
        self._r = redis.Redis.from_url(
            redis_url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 1),
            decode_responses=True,
            encoding_errors="replace",  # a value that is not UTF-8 fails its own record's parse, not the whole reply
        )
        self._prune = self._r.register_script(_PRUNE_LUA)

    # -- keys ---------------------------------------------------------------
    @property
    def _set_key(self) -> str:
        return self.prefix + "workers"

    def _info_key(self, worker_id: str) -> str:
        return f"{self.prefix}worker:{worker_id}:info"

    def _hb_key(self, worker_id: str) -> str:
        return f"{self.prefix}worker:{worker_id}:hb"

    # -- workers ------------------------------------------------------------
    def next_generation(self, worker_id: str) -> int:
        """The next generation of ``worker_id`` (1, 2, ...): a counter kept in Redis (and in its
        append-only file where the cluster's Redis has one), so a replacement process of a worker
        that died registers under a new generation.

        Raises:
            redis.exceptions.RedisError: Redis unreachable or failing.
        """
        return int(self._r.incr(f"{self.prefix}worker:{worker_id}:generation"))

    def register(self, info: WorkerInfo, ttl_s: float) -> None:
        """Write (or overwrite) a worker's info; it stays for ``ttl_s`` seconds
        unless heartbeats refresh it. It is not live until its first heartbeat.

        Raises:
            ValueError: ``ttl_s`` is not positive.
            redis.exceptions.RedisError: Redis unreachable or failing.
        """
        ttl_ms = _ttl_ms(ttl_s)
        key = self._info_key(info.worker_id)
        with self._r.pipeline(transaction=True) as p:
            p.delete(key)
            p.hset(key, mapping=info.to_hash())
            p.pexpire(key, ttl_ms)
            p.sadd(self._set_key, info.worker_id)
            p.execute()

    def heartbeat(self, worker_id: str, load: WorkerLoadSnapshot, ttl_s: float) -> bool:
        """Mark ``worker_id`` live for ``ttl_s`` seconds with ``load``, and extend
        its info's TTL.

        Returns:
            ``True`` if the worker's info exists; ``False`` if it is missing
            (expired, or Redis restarted and lost it) - call :meth:`register`.

        Raises:
            ValueError: ``ttl_s`` is not positive.
            redis.exceptions.RedisError: Redis unreachable or failing.
        """
        ttl_ms = _ttl_ms(ttl_s)
        with self._r.pipeline(transaction=True) as p:
            p.pexpire(self._info_key(worker_id), ttl_ms)
            p.set(self._hb_key(worker_id), load.to_json(), px=ttl_ms)
            p.sadd(self._set_key, worker_id)
            info_present, _, _ = p.execute()
        return bool(info_present)

    def deregister(self, worker_id: str) -> None:
        """Remove a worker at once (info, liveness key, set membership).

        Raises:
            redis.exceptions.RedisError: Redis unreachable or failing.
        """
        with self._r.pipeline(transaction=True) as p:
            p.delete(self._info_key(worker_id), self._hb_key(worker_id))
            p.srem(self._set_key, worker_id)
            p.execute()

    def live_workers(self, role: str | None = None) -> list[tuple[WorkerInfo, WorkerLoadSnapshot]]:
        """Workers whose liveness key exists (and whose info is present),
        sorted by worker id, optionally only those of ``role``.

        Raises:
            redis.exceptions.RedisError: Redis unreachable or failing.
        """
        ids = sorted(self._r.smembers(self._set_key))
        if not ids:
            return []
        with self._r.pipeline(transaction=False) as p:
            for wid in ids:
                p.hgetall(self._info_key(wid))
                p.get(self._hb_key(wid))
            replies = p.execute(raise_on_error=False)  # a key of the wrong type: its error fails its own parse
        out: list[tuple[WorkerInfo, WorkerLoadSnapshot]] = []
        for i, wid in enumerate(ids):
            info_h, hb = replies[2 * i], replies[2 * i + 1]
            if not info_h and hb is None:
                self._prune(keys=[self._set_key, self._info_key(wid), self._hb_key(wid)], args=[wid])
                continue
            if not info_h or hb is None:
                continue  # registered but not beating yet, or info lost until re-registration
            try:
                info, load = WorkerInfo.from_hash(info_h), WorkerLoadSnapshot.from_json(hb)
            except (KeyError, TypeError, ValueError) as e:
                log.warning("skipping malformed registry entry %r: %s", wid, e)
                continue
            if role is None or info.role == role:
                out.append((info, load))
        return out

    def get(self, worker_id: str) -> WorkerInfo | None:
        """The registered info of ``worker_id``, live or not; ``None`` if absent.

        Raises:
            redis.exceptions.RedisError: Redis unreachable or failing.
        """
        h = self._r.hgetall(self._info_key(worker_id))
        return WorkerInfo.from_hash(h) if h else None

    # -- cluster state documents --------------------------------------------
    def put_state(self, key: str, value: dict, ttl_s: float | None = None) -> None:
        """Store ``value`` (JSON-able) under ``state:<key>``, expiring after ``ttl_s`` seconds
        when given.

        Raises:
            redis.exceptions.RedisError: Redis unreachable or failing.
        """
        self._r.set(f"{self.prefix}state:{key}", json.dumps(value),
                    px=_ttl_ms(ttl_s) if ttl_s is not None else None)

    def get_state(self, key: str) -> dict | None:
        """The document stored under ``state:<key>``, ``None`` if absent.

        Raises:
            redis.exceptions.RedisError: Redis unreachable or failing.
        """
        raw = self._r.get(f"{self.prefix}state:{key}")
        return json.loads(raw) if raw is not None else None

    # -- routers --------------------------------------------------------------
    def put_router(self, record: RouterRecord, ttl_s: float) -> None:
        """Mark a router live for ``ttl_s`` seconds (it refreshes its record every heartbeat).

        Raises:
            ValueError: ``ttl_s`` is not positive.
            redis.exceptions.RedisError: Redis unreachable or failing.
        """
        self._r.set(f"{self.prefix}router:{record.index}", json.dumps(asdict(record)), px=_ttl_ms(ttl_s))

    def remove_router(self, index: int) -> None:
        """Forget router ``index`` at once (it stops).

        Raises:
            redis.exceptions.RedisError: Redis unreachable or failing.
        """
        self._r.delete(f"{self.prefix}router:{index}")

    def live_routers(self) -> list[RouterRecord]:
        """The routers whose record has not expired, by index.

        Raises:
            redis.exceptions.RedisError: Redis unreachable or failing.
        """
        keys = sorted(self._r.scan_iter(match=f"{self.prefix}router:*", count=100))
        out = []
        for raw in self._r.mget(keys) if keys else []:
            if raw is None:
                continue  # expired between the scan and the read
            try:
                out.append(RouterRecord.from_json(raw))
            except (TypeError, ValueError) as e:
                log.warning("skipping malformed router record %r: %s", raw, e)
        return sorted(out, key=lambda r: r.index)

    def server_pid(self) -> int:
        """Process id of the Redis server (``INFO server``), for supervision and fault injection.

        Raises:
            redis.exceptions.RedisError: Redis unreachable or failing.
        """
        return int(self._r.info("server")["process_id"])

    def close(self) -> None:
        """Release the connection pool."""
        self._r.close()


def _ttl_ms(ttl_s: float) -> int:
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be positive, got {ttl_s}")
    return max(1, int(round(ttl_s * 1000)))
