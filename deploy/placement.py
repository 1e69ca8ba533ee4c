"""Where workers go: placement-group bundles, strategies, pinning, and why a placement fails.

Every worker gets one bundle: one GPU (and one CPU) where the cluster has GPUs
(or ``--worker-gpus`` of one, so that workers share a GPU), a CPU share otherwise,
times the worker's tensor-parallel ranks (``--prefill-tp`` / ``--decode-tp``: the
ranks are processes on the bundle's node). A bundle may carry a small amount (:data:`PIN_AMOUNT`) of
a custom resource, which pins the worker to nodes that advertise it (``ray start
--resources='{"prefill_node": 1}'``): that is how prefill and decode workers go
to different machine kinds. The bundles of one ``up`` (or one ``scale``) form
one placement group with the chosen strategy (:data:`STRATEGIES`).

When the group cannot be placed within the timeout, :func:`reserve` removes it
and raises :class:`PlacementError` saying what is missing (a resource no node
has, more of it than the cluster holds, too few nodes for a strict strategy, or
resources that exist but are in use) and pointing at ``ray status``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from common.model_config import FieldError

# CLI name -> Ray placement-group strategy.
STRATEGIES = {"pack": "PACK", "spread": "SPREAD", "strict-pack": "STRICT_PACK", "strict-spread": "STRICT_SPREAD"}
# Amount of a pinning resource one worker takes (a node advertising 1 holds 100 workers).
PIN_AMOUNT = 0.01
_BUILTIN = ("CPU", "GPU", "memory", "object_store_memory")


class PlacementError(RuntimeError):
    """The requested workers cannot be placed on this Ray cluster (the message says why)."""


@dataclass(frozen=True)
class PlacementConfig:
    """How workers are placed.

    Attributes:
        strategy: ``pack`` (fill a node first: prefill and decode workers share a
            node when they fit, so KV moves over loopback), ``spread`` (one per node
            where possible, for fault isolation), ``strict-pack`` (all on one node
            or fail), ``strict-spread`` (each on its own node or fail).
        prefill_resource / decode_resource / colocated_resource: custom Ray
            resource a node must advertise to host that role's workers (``None``:
            any node).
        worker_cpus: logical CPUs per worker bundle; ``None`` derives it (1 with
            GPUs, else the cluster's CPUs divided among the workers, at most 1).
        worker_gpus: fraction of a GPU per worker (per tensor-parallel rank) where the
            cluster has GPUs, in (0, 1]; ``None`` = 1. Below 1, Ray may put several workers
            on one GPU (e.g. 0.5: a prefill and a decode worker share one); they then share
            its memory (each takes its ``--kv-cache-gb`` plus the weights).
        timeout_s: seconds to wait for Ray to reserve the bundles.
        prefill_threads / decode_threads: torch intra-op threads of each prefill / decode
            worker (``None``: its CPU share, :attr:`WorkerShape.threads`). A phase's own
            parallelism, as DistServe chooses per phase: e.g. on 2 cores a prefill worker on
            2 threads takes the core the decode worker leaves idle during a burst of long
            prompts. Threads only: the bundles (reserved CPUs) stay as they are.

    Raises:
        common.model_config.FieldError: naming the field: unknown strategy, non-positive
            ``worker_cpus`` / ``timeout_s`` / ``prefill_threads`` / ``decode_threads``,
            ``worker_gpus`` outside (0, 1], or a pinning resource named like a built-in one
            (``CPU``, ``GPU``...).
    """

    strategy: str = "pack"
    prefill_resource: str | None = None
    decode_resource: str | None = None
    colocated_resource: str | None = None
    worker_cpus: float | None = None
    timeout_s: float = 120.0
    worker_gpus: float | None = None
    prefill_threads: int | None = None
    decode_threads: int | None = None

    def __post_init__(self) -> None:
        for name in ("prefill_threads", "decode_threads"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise FieldError(name, "must be an integer >= 1", value)
        if self.strategy not in STRATEGIES:
            raise FieldError("strategy", f"must be one of {sorted(STRATEGIES)}", self.strategy)
        if self.worker_cpus is not None and not self.worker_cpus > 0:
            raise FieldError("worker_cpus", "must be > 0", self.worker_cpus)
        if self.worker_gpus is not None and not 0 < self.worker_gpus <= 1:
            raise FieldError("worker_gpus", "must be in (0, 1]", self.worker_gpus)
        if not self.timeout_s > 0:
            raise FieldError("timeout_s", "must be > 0", self.timeout_s)
        for name in ("prefill_resource", "decode_resource", "colocated_resource"):
            value = getattr(self, name)
            if value is not None and (not value or value in _BUILTIN):
                raise FieldError(name, f"must be a custom resource name (not {', '.join(_BUILTIN)})", value)

    @property
    def ray_strategy(self) -> str:
        return STRATEGIES[self.strategy]

    def threads(self, role: str, shape: "WorkerShape") -> int:
        """Torch intra-op threads of a ``role`` worker of ``shape``: its role's override, else
        the shape's share."""
        override = {"prefill": self.prefill_threads, "decode": self.decode_threads}.get(role)
        return override if override is not None else shape.threads

    def pin(self, role: str) -> str | None:
        """The custom resource pinning ``role``'s workers, or ``None``."""
        return {"prefill": self.prefill_resource, "decode": self.decode_resource,
                "colocated": self.colocated_resource}.get(role)


@dataclass(frozen=True)
class WorkerShape:
    """Resources of one worker, decided once by ``up`` and reused by ``scale``.

    Attributes:
        cpus: logical CPUs in the worker's bundle.
        gpus: GPUs in the bundle per tensor-parallel rank (0, 1, or a fraction of one).
        threads: torch intra-op threads of the worker.
        device: ``"cuda"`` or ``"cpu"``.
    """

    cpus: float
    gpus: float
    threads: int
    device: str

    def bundle(self, role: str, cfg: PlacementConfig, tp: int = 1) -> dict[str, float]:
        """The placement-group bundle of one ``role`` worker of ``tp`` tensor-parallel ranks
        (its ranks run on one node: the bundle holds ``tp`` times the per-rank CPUs and GPUs)."""
        b = {"CPU": self.cpus * tp}
        if self.gpus:
            b["GPU"] = self.gpus * tp
        pin = cfg.pin(role)
        if pin:
            b[pin] = PIN_AMOUNT
        return b


def decide_shape(cluster_resources: dict, num_workers: int, device: str, worker_cpus: float | None,
                 worker_gpus: float | None = None) -> WorkerShape:
    """One GPU (or ``worker_gpus`` of one) per worker where the cluster has GPUs (and ``device``
    allows), else a CPU share.

    On CPU a worker gets the torch threads of its share of the cluster's CPUs but its bundle
    reserves half that share (at most half a CPU), so that ``pdcluster scale`` can add as many
    workers again on the same machines without a restart: workers then share cores (on this
    2-core machine a 1P+1D cluster can grow to 4 workers). ``worker_cpus`` reserves exactly
    that many.

    Args:
        cluster_resources: ``ray.cluster_resources()``.
        num_workers: worker processes placed now, every tensor-parallel rank counted (the CPU
            share divides among them; the shape is per rank, a worker's bundle is ``tp`` shapes).
        device: ``"auto"``, ``"cuda"`` or ``"cpu"``.
        worker_cpus: explicit logical CPUs per worker, or ``None``.
        worker_gpus: fraction of a GPU per worker (rank), or ``None`` for a whole one.
    """
    if cluster_resources.get("GPU", 0) >= 1 and device in ("auto", "cuda"):
        return WorkerShape(worker_cpus or 1.0, worker_gpus or 1.0, max(1, math.floor(worker_cpus or 1.0)), "cuda")
    cpus = cluster_resources.get("CPU", 1.0)
    if worker_cpus is not None:
        return WorkerShape(worker_cpus, 0.0, max(1, math.floor(worker_cpus)), "cpu")
    return WorkerShape(min(1.0, cpus / num_workers) / 2, 0.0, max(1, math.floor(cpus / num_workers)), "cpu")


def reserve(bundles: list[dict], strategy: str, name: str, timeout_s: float) -> PlacementGroup:
    """Create a detached placement group and wait until Ray reserved every bundle.

    Args:
        bundles: one resource dict per worker.
        strategy: a Ray strategy (``PACK``, ``SPREAD``, ``STRICT_PACK``, ``STRICT_SPREAD``).
        name: the group's name (``pdcluster down`` finds it by name).
        timeout_s: seconds to wait.

    Raises:
        PlacementError: not placed within ``timeout_s`` (the group is removed; the
            message names what is missing and points at ``ray status``).
    """
    pg = placement_group(bundles, strategy=strategy, name=name, lifetime="detached")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        reasons = diagnose(bundles, strategy, nodes, ray.available_resources())
        raise PlacementError(
            f"could not place {len(bundles)} workers (strategy {strategy}) within {timeout_s:.0f}s: "
            + "; ".join(reasons)
            + f". Bundles asked for: {_bundle_summary(bundles)}. Cluster total: {_fmt(ray.cluster_resources())}."
            " Run `ray status` on the head node to see the nodes, their resources and the pending demands."
        ) from None
    return pg


def diagnose(bundles: list[dict], strategy: str, nodes: list[dict], available: dict) -> list[str]:
    """Why ``bundles`` cannot be placed on ``nodes`` (each a dict of total resources).

    Returns:
        Human-readable reasons, most specific first; never empty.
    """
    reasons: list[str] = []
    for key in sorted({k for b in bundles for k in b}):
        need_one = max(b.get(key, 0) for b in bundles)
        need_all = sum(b.get(key, 0) for b in bundles)
        best = max((n.get(key, 0) for n in nodes), default=0)
        total = sum(n.get(key, 0) for n in nodes)
        if best == 0:
            reasons.append(f"no node has resource {key!r} (start the nodes meant for it with "
                           f"`ray start ... --resources='{{\"{key}\": 1}}'`)" if key not in _BUILTIN
                           else f"no node has any {key}")
        elif best + 1e-9 < need_one:
            reasons.append(f"a worker needs {need_one:g} {key} but the largest node has {best:g}")
        elif total + 1e-9 < need_all:
            reasons.append(f"the workers need {need_all:g} {key} in total, the cluster has {total:g}")
    if strategy == "STRICT_SPREAD" and len(nodes) < len(bundles):
        reasons.append(f"STRICT_SPREAD needs {len(bundles)} nodes, the cluster has {len(nodes)}")
    if strategy == "STRICT_PACK" and not any(_fits_all(n, bundles) for n in nodes):
        reasons.append("STRICT_PACK needs one node holding every bundle, and none does")
    if not reasons:
        reasons.append(f"the resources exist but are in use or fragmented (available now: {_fmt(available)}); "
                       "free them (e.g. `pdcluster down` another cluster) or add nodes")
    return reasons


def _fits_all(node: dict, bundles: list[dict]) -> bool:
    keys = {k for b in bundles for k in b}
    return all(node.get(k, 0) + 1e-9 >= sum(b.get(k, 0) for b in bundles) for k in keys)


def _fmt(resources: dict) -> str:
    shown = {k: round(v, 2) for k, v in sorted(resources.items())
             if not k.startswith("node:") and k not in ("memory", "object_store_memory")}
    return str(shown)


def _bundle_summary(bundles: list[dict]) -> str:
    counts: dict[str, int] = {}
    for b in bundles:
        key = str({k: round(v, 3) for k, v in sorted(b.items())})
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} x {k}" for k, n in counts.items())
