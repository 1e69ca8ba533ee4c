"""Place and start a pdcluster on a running Ray cluster.

Workers are Ray actors in placement groups, one bundle each (:mod:`deploy.placement`:
one GPU per worker where the cluster has GPUs, a CPU share otherwise; strategy
and pinning resources chosen by the caller). Each router (``--routers N``, one by
default) is a zero-CPU actor on the Ray head node; they share the public ports
(:class:`deploy.actors.RouterActor`). All actors are detached and named ``pdcluster-<cluster>-<id>``
in the ``pdcluster`` namespace, so ``pdcluster down`` / ``scale`` (other
processes) find them. Worker ids are ``<role>-<index>``; indices are never reused
within a cluster, so a removed worker's id is never taken by a new one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field, replace

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from common.model_config import FieldError
from deploy.actors import RouterActor, WorkerActor
from deploy.placement import PlacementConfig, PlacementError, WorkerShape, decide_shape, reserve
from engine.config import CacheConfig, SchedulerConfig
from router.config import RouterConfig
from serving.registry import WORKER_ROLES
from serving.worker_config import WorkerConfig

log = logging.getLogger(__name__)
NAMESPACE = "pdcluster"


class _PlacementGroupRemovalNotice(logging.Filter):
    """Drops Ray's warning that a restartable detached actor dies with its placement group:
    that is how ``down`` and ``scale`` remove workers, and Ray restarts a crashed worker in
    its bundle as long as the group lives."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "restartable detached actor with a placement group" not in record.getMessage()


logging.getLogger("ray.actor").addFilter(_PlacementGroupRemovalNotice())


@dataclass(frozen=True)
class ClusterSpec:
    """What to start.

    Attributes:
        num_prefill / num_decode: disaggregated worker counts (both >= 1), or both 0
            with ``num_colocated`` >= 1.
        worker: template worker config (role, id, host, device and threads are
            filled in per worker).
        router: router config.
        placement: strategy, pinning resources, CPUs per worker, placement timeout.
        num_colocated: colocated workers (prefill and decode on one engine).
        timeout_s: seconds to wait for every server to come up once placed.
        num_routers: router processes behind the one address (>= 1; more than one needs
            ``router.reuse_port``).

    Raises:
        ValueError: a worker mix other than the two above; a :class:`common.model_config.FieldError`
            naming the field: a negative count, a non-positive timeout, fewer than one router, or
            several without ``router.reuse_port``.
    """

    num_prefill: int
    num_decode: int
    worker: WorkerConfig
    router: RouterConfig
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    num_colocated: int = 0
    timeout_s: float = 300.0
    num_routers: int = 1

    def __post_init__(self) -> None:
        if self.num_routers < 1 or (self.num_routers > 1 and not self.router.reuse_port):
            raise FieldError("num_routers", "must be >= 1 (several need router.reuse_port)", self.num_routers)
        for name in ("num_prefill", "num_decode", "num_colocated"):
            if getattr(self, name) < 0:
                raise FieldError(name, "must be >= 0", getattr(self, name))
        if self.num_colocated and (self.num_prefill or self.num_decode):
            raise ValueError("colocated workers replace prefill/decode workers: give one kind, not both")
        if not self.num_colocated and (self.num_prefill < 1 or self.num_decode < 1):
            raise ValueError("need at least one prefill and one decode worker (or colocated workers)")
        if not self.timeout_s > 0:
            raise FieldError("timeout_s", "must be > 0", self.timeout_s)

    def counts(self) -> dict[str, int]:
        return {"prefill": self.num_prefill, "decode": self.num_decode, "colocated": self.num_colocated}


def actor_name(cluster: str, ident: str) -> str:
    return f"pdcluster-{cluster}-{ident}"


def router_actor_name(cluster: str, index: int) -> str:
    """Actor name of router ``index`` (the first keeps the single-router name ``...-router``)."""
    return actor_name(cluster, "router" if index == 0 else f"router-{index}")


def router_actor_names(state: dict) -> list[str]:
    """Actor names of every desired router of the cluster ``state`` describes."""
    return [router_actor_name(state["cluster"], i) for i in range(state.get("num_routers", 1))]


def create_router_actor(cluster: str, cfg: RouterConfig, follow: bool):
    """Create the detached actor of router ``cfg.index`` on the head node (zero CPUs); returns
    its handle. ``follow``: it starts at once on the ports recorded in Redis
    (:class:`deploy.actors.RouterActor`); otherwise call its ``start``."""
    return RouterActor.options(
        name=router_actor_name(cluster, cfg.index), namespace=NAMESPACE, lifetime="detached", num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(head_node_id(), soft=False),
    ).remote(cfg, follow)


def start_routers(spec: "ClusterSpec", first: dict) -> list[dict]:
    """Start routers 1 .. N-1 on the ports router 0 recorded and wait until they serve; returns
    every router's start result (``first``: router 0's).

    Raises:
        RuntimeError: a router failed to start or did not within ``spec.timeout_s``.
    """
    cluster = spec.worker.cluster
    others = [create_router_actor(cluster, replace(spec.router, index=i), follow=True)
              for i in range(1, spec.num_routers)]
    return [first, *ray.get([a.started.remote(spec.timeout_s) for a in others], timeout=spec.timeout_s + 10)]


def worker_config_to_dict(cfg: WorkerConfig) -> dict:
    """JSON-able form of a worker config (kept in the state file for ``scale``)."""
    return asdict(cfg)


def worker_config_from_dict(d: dict) -> WorkerConfig:
    """Inverse of :func:`worker_config_to_dict`.

    Raises:
        TypeError / common.model_config.ConfigError: the dict does not describe a valid config.
    """
    return WorkerConfig.from_dict(d)


def head_node_id() -> str:
    """Node id of the Ray head (the driver's node if none is marked as head)."""
    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            return node["NodeID"]
    return ray.get_runtime_context().get_node_id()


def start_workers(cluster: str, template: WorkerConfig, shape: WorkerShape, placement: PlacementConfig,
                  new: list[tuple[str, str]], pg_name: str, timeout_s: float) -> list[dict]:
    """Reserve one placement group for ``new`` workers, start them and wait until they serve.

    Args:
        cluster: cluster name.
        template: worker config template.
        shape: per-worker resources (from :func:`deploy.placement.decide_shape`).
        placement: strategy, pinning resources and placement timeout.
        new: ``(role, worker_id)`` of each worker to start.
        pg_name: name of the placement group to create.
        timeout_s: seconds to wait for the workers to load and register.

    Returns:
        One state entry per worker: ``worker_id, role, actor, address, pid, node_id,
        placement_group, bundle_index``.

    Raises:
        PlacementError: the bundles were not placed within ``placement.timeout_s``.
        RuntimeError: a worker failed to start (the started ones are killed again and
            the placement group removed).
    """
    cfgs = [worker_config(template, shape, placement, role, wid) for role, wid in new]
    bundles = [shape.bundle(cfg.role, placement, cfg.tp) for cfg in cfgs]
    pg = reserve(bundles, placement.ray_strategy, pg_name, placement.timeout_s)
    actors, infos = [], []
    for i, (role, wid) in enumerate(new):
        actors.append(create_worker_actor(cluster, cfgs[i], shape, pg, i))
        infos.append({"worker_id": wid, "role": role, "actor": actor_name(cluster, wid),
                      "placement_group": pg_name, "bundle_index": i})
    try:
        started = ray.get([a.start.remote() for a in actors], timeout=timeout_s)
    except Exception as e:
        kill_actors([i["actor"] for i in infos])
        remove_placement_group(pg)
        raise RuntimeError(f"pdcluster workers failed to start: {e}") from e
    for info, s in zip(infos, started):
        info.update(s)
    return infos


def worker_config(template: WorkerConfig, shape: WorkerShape, placement: PlacementConfig, role: str,
                  worker_id: str) -> WorkerConfig:
    """The config of one ``role`` worker: the template's, with the shape's device and the
    role's threads (:meth:`deploy.placement.PlacementConfig.threads`)."""
    return template.for_role(role, worker_id, num_threads=placement.threads(role, shape), device=shape.device)


def create_worker_actor(cluster: str, cfg: WorkerConfig, shape: WorkerShape, pg, bundle_index: int):
    """Create the detached actor of one worker in bundle ``bundle_index`` of placement group ``pg``
    (it starts loading at once: :class:`deploy.actors.WorkerActor`); returns its handle. The actor
    holds its whole bundle: ``cfg.tp`` ranks' CPUs and GPUs (Ray shows rank ``r`` GPU ``cuda:r``)."""
    return WorkerActor.options(
        name=actor_name(cluster, cfg.worker_id), namespace=NAMESPACE, lifetime="detached",
        num_cpus=shape.cpus * cfg.tp, num_gpus=shape.gpus * cfg.tp,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle_index),
    ).remote(cfg)


def recreate_worker(state: dict, entry: dict) -> None:
    """Create again the actor of a desired worker whose actor is gone for good, with the same id
    in the same placement-group bundle (it registers under the next generation).

    Raises:
        ValueError: its placement group no longer exists.
    """
    template = worker_config_from_dict(state["worker_template"])
    shape = WorkerShape(**state["shape"])
    cfg = worker_config(template, shape, PlacementConfig(**state["placement"]), entry["role"], entry["worker_id"])
    pg = ray.util.get_placement_group(entry["placement_group"])
    create_worker_actor(state["cluster"], cfg, shape, pg, entry["bundle_index"])


def launch(spec: ClusterSpec) -> dict:
    """Place and start every worker and the ``spec.num_routers`` routers (router 0 first: it
    picks the shared ports the others bind); returns the cluster state dict (router address,
    ``routers``, workers with address/pid/node/placement group, what ``scale`` needs to add
    more workers alike).

    Raises:
        PlacementError: the workers could not be placed within ``spec.placement.timeout_s``
            (the message names what is missing and points at ``ray status``).
        RuntimeError: a worker or the router failed to start (with its cause).
    """
    cluster = spec.worker.cluster
    counts = spec.counts()
    ranks = sum(n * spec.worker.for_role(role, "-").tp for role, n in counts.items())  # a TP worker's ranks share
    shape = decide_shape(ray.cluster_resources(), ranks, spec.worker.device, spec.placement.worker_cpus,
                         spec.placement.worker_gpus)
    new = [(role, f"{role}-{i}") for role in WORKER_ROLES for i in range(counts[role])]
    pg_name = actor_name(cluster, "pg-0")
    state = {"cluster": cluster, "redis_url": spec.worker.redis_url, "workers": [], "placement_groups": [pg_name],
             "placement": asdict(spec.placement), "shape": asdict(shape),
             "worker_template": worker_config_to_dict(spec.worker), "next_index": dict(counts), "next_pg": 1}
    state["num_routers"] = spec.num_routers
    router = create_router_actor(cluster, replace(spec.router, index=0), follow=False)
    router_started = router.start.remote()  # loads its tokenizer while the workers are placed
    try:
        state["workers"] = start_workers(cluster, spec.worker, shape, spec.placement, new, pg_name, spec.timeout_s)
        routers = start_routers(spec, ray.get(router_started, timeout=spec.timeout_s))
    except Exception as e:
        teardown(state)
        if isinstance(e, PlacementError):
            raise
        raise RuntimeError(f"pdcluster failed to start: {e}") from e
    r = routers[0]
    state.update(router_address=r["address"], router_http_address=r["http_address"], router_pid=r["pid"],
                 router_node_id=r["node_id"],
                 routers=[{"index": x["index"], "actor": router_actor_name(cluster, x["index"]), "pid": x["pid"],
                           "metrics_address": x["metrics_address"]} for x in routers])
    return state


def kill_actors(names: list[str], stop_timeout_s: float = 10.0) -> None:
    """Stop the named actors gracefully, all at once, then kill them; missing ones are skipped.

    Each actor's ``stop()`` (it unregisters from Redis, closes its servers) gets ``stop_timeout_s``
    seconds in all, shared by the actors: an actor that has not stopped by then (Redis paused, the
    actor hung) is killed without it, and a warning names it.
    """
    actors = {}
    for name in names:
        try:
            actors[name] = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            continue
    stops = {name: actor.stop.remote() for name, actor in actors.items()}
    deadline = time.monotonic() + stop_timeout_s
    for name, ref in stops.items():
        try:
            ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except GetTimeoutError:
            log.warning("stopping %s: it did not stop within %.0f s; killing it", name, stop_timeout_s)
        except Exception as e:  # noqa: BLE001 - killed below anyway
            log.warning("stopping %s: %s: %s; killing it", name, type(e).__name__, e)
    for actor in actors.values():
        ray.kill(actor, no_restart=True)


def remove_groups(names: list[str]) -> None:
    """Remove the named placement groups (missing ones are skipped)."""
    for name in names:
        try:
            remove_placement_group(ray.util.get_placement_group(name))
        except ValueError:
            pass


def teardown(state: dict) -> None:
    """Stop and kill every actor of the cluster (its controller first, so that nothing is
    restarted) and remove its placement groups (idempotent)."""
    cluster = state["cluster"]
    kill_actors([actor_name(cluster, "controller")])
    kill_actors([w["actor"] for w in state.get("workers", [])] + router_actor_names(state))
    groups = list(state.get("placement_groups", []))
    if state.get("placement_group"):  # state files written before scaling existed
        groups.append(state["placement_group"])
    remove_groups(groups)


def default_worker_config(**kw) -> WorkerConfig:
    """Template worker config (role/id are overwritten per worker by :func:`launch`)."""
    return WorkerConfig(role="prefill", worker_id="template", **kw)


__all__ = [
    "CacheConfig", "ClusterSpec", "PlacementConfig", "PlacementError", "SchedulerConfig", "WORKER_ROLES", "launch",
    "start_workers", "create_router_actor", "router_actor_name", "router_actor_names", "create_worker_actor",
    "recreate_worker", "teardown", "kill_actors", "remove_groups", "head_node_id", "worker_config_to_dict",
    "worker_config_from_dict", "default_worker_config", "actor_name", "NAMESPACE"
]
