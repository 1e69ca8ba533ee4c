"""Place and start a pdcluster on a running Ray cluster.

Workers are Ray actors in one placement group, a bundle each: one GPU per worker
where the cluster has GPUs, a CPU share otherwise (each worker then limits its
torch threads to that share). The router is a zero-CPU actor on the driver's
node. All actors are detached and named ``pdcluster-<cluster>-<id>`` in the
``pdcluster`` namespace, so ``pdcluster down`` (another process) finds them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from deploy.actors import RouterActor, WorkerActor
from engine.config import CacheConfig, SchedulerConfig, WorkerConfig
from router.server import RouterConfig

log = logging.getLogger(__name__)
NAMESPACE = "pdcluster"


class PlacementError(RuntimeError):
    """The requested workers cannot be placed on this Ray cluster."""


@dataclass(frozen=True)
class ClusterSpec:
    """What to start.

    Attributes:
        num_prefill / num_decode: worker counts.
        worker: template worker config (role and id are filled in per worker).
        router: router config.
        strategy: placement group strategy (``PACK``, ``SPREAD``, ``STRICT_PACK``...).
        timeout_s: seconds to wait for placement and for every server to come up.
    """

    num_prefill: int
    num_decode: int
    worker: WorkerConfig
    router: RouterConfig
    strategy: str = "PACK"
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("need at least one prefill and one decode worker")


def actor_name(cluster: str, ident: str) -> str:
    return f"pdcluster-{cluster}-{ident}"


def _bundles(spec: ClusterSpec) -> tuple[list[dict], int, bool]:
    """One bundle per worker; returns (bundles, torch threads per worker, use_gpu)."""
    res = ray.cluster_resources()
    n = spec.num_prefill + spec.num_decode
    if res.get("GPU", 0) >= 1 and spec.worker.device in ("auto", "cuda"):
        return [{"GPU": 1.0, "CPU": 1.0} for _ in range(n)], 1, True
    cpus = res.get("CPU", 1.0)
    share = min(1.0, cpus / n)
    return [{"CPU": share} for _ in range(n)], max(1, math.floor(cpus / n)), False


def launch(spec: ClusterSpec) -> dict:
    """Place and start every worker and the router; returns the cluster state dict
    (router address, workers with address/pid/node, placement group name).

    Raises:
        PlacementError: the placement group is not ready within ``spec.timeout_s``
            (the message lists the bundles asked for and points at ``ray status``).
        RuntimeError: a worker or the router failed to start (with its cause).
    """
    cluster = spec.worker.cluster
    bundles, threads, use_gpu = _bundles(spec)
    pg_name = actor_name(cluster, "pg")
    pg = placement_group(bundles, strategy=spec.strategy, name=pg_name, lifetime="detached")
    try:
        ray.get(pg.ready(), timeout=spec.timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise PlacementError(
            f"could not place {len(bundles)} workers with bundles {bundles[0]} each "
            f"(strategy {spec.strategy}) within {spec.timeout_s:.0f}s; the cluster has "
            f"{ray.cluster_resources()} — check `ray status`") from None
    roles = ["prefill"] * spec.num_prefill + ["decode"] * spec.num_decode
    idx = {"prefill": 0, "decode": 0}
    actors, infos = [], []
    for i, role in enumerate(roles):
        wid = f"{role}-{idx[role]}"
        idx[role] += 1
        cfg = replace(spec.worker, role=role, worker_id=wid, num_threads=threads,
                      device="cuda" if use_gpu else "cpu")
        actor = WorkerActor.options(
            name=actor_name(cluster, wid), namespace=NAMESPACE, lifetime="detached",
            num_cpus=bundles[i].get("CPU", 0), num_gpus=bundles[i].get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        ).remote(cfg)
        actors.append(actor)
        infos.append({"worker_id": wid, "role": role, "actor": actor_name(cluster, wid)})
    here = ray.get_runtime_context().get_node_id()
    router = RouterActor.options(
        name=actor_name(cluster, "router"), namespace=NAMESPACE, lifetime="detached", num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
    ).remote(spec.router)
    try:
        started = ray.get([a.start.remote() for a in actors] + [router.start.remote()], timeout=spec.timeout_s)
    except Exception as e:
        teardown({"cluster": cluster, "workers": infos, "placement_group": pg_name})
        raise RuntimeError(f"pdcluster failed to start: {e}") from e
    for info, s in zip(infos, started):
        info.update(s)
    return {"cluster": cluster, "router_address": started[-1]["address"], "router_pid": started[-1]["pid"],
            "workers": infos, "placement_group": pg_name, "redis_url": spec.worker.redis_url}


def teardown(state: dict) -> None:
    """Stop and kill every actor of the cluster and remove its placement group (idempotent)."""
    cluster = state["cluster"]
    names = [w["actor"] for w in state.get("workers", [])] + [actor_name(cluster, "router")]
    for name in names:
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            continue
        try:
            ray.get(actor.stop.remote(), timeout=10)
        except Exception as e:  # noqa: BLE001 - killed below anyway
            log.warning("stopping %s: %s", name, e)
        ray.kill(actor, no_restart=True)
    try:
        pg = ray.util.get_placement_group(state["placement_group"])
        remove_placement_group(pg)
    except (ValueError, KeyError):
        pass


def default_worker_config(**kw) -> WorkerConfig:
    """Template worker config (role/id are overwritten per worker by :func:`launch`)."""
    return WorkerConfig(role="prefill", worker_id="template", **kw)


__all__ = ["CacheConfig", "ClusterSpec", "PlacementError", "SchedulerConfig", "launch", "teardown",
           "default_worker_config", "actor_name", "NAMESPACE"]
