"""The cluster controller: keeps the desired workers running and the local Redis up.

One detached Ray actor per cluster (``pdcluster-<cluster>-controller``, zero CPUs, on the
head node, itself restarted by Ray). It owns the cluster's **desired state**: the workers
that should exist (id, role, placement-group bundle) and how to build them (template config,
shape), kept in Redis (``state:desired``, in the append-only file; without the cluster's secrets,
which a restarted controller takes from the arguments Ray gives it again) and returned to the CLI
for the state file. Every period (the heartbeat period) it

1. PINGs the cluster Redis where ``up`` started it, and after ``redis_down_checks`` failed PINGs
   kills it if it still runs (hung) and restarts it (:mod:`deploy.redis_supervisor`; same port,
   password and append-only file);
2. compares the desired workers with the live registry; each missing one is probed through
   its actor and healed by the rules of :mod:`deploy.heal` (Ray restarts crashed actors by
   itself; the controller restarts hung, paused or failed ones and recreates killed ones);
3. keeps the desired routers (``pdcluster up --routers N``) by the same rules: Ray restarts a
   crashed router actor in place; a hung or paused one (no record, its actor silent) is killed
   with restart; one whose actor is gone for good (killed without restart) is created again
   with the same index, on the same shared ports (:func:`deploy.cluster.create_router_actor`);
4. publishes a report (``state:controller``: desired counts, each worker's liveness and why
   it is missing, live routers, Redis restarts), which ``pdcluster status`` prints.

``pdcluster scale`` goes through :meth:`ControllerActor.scale`, so one owner changes the
desired state: it heals first (a dead worker is replaced, not counted), then adds or drains
workers (:func:`deploy.scale.scale`) and waits until every desired worker is live.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

import ray
from redis.exceptions import RedisError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from deploy.actors import was_restarted
from deploy.cluster import (
    NAMESPACE,
    WORKER_ROLES,
    actor_name,
    create_router_actor,
    head_node_id,
    recreate_worker,
    router_actor_name,
    worker_config_from_dict,
)
from deploy.heal import Action, HealConfig, Probe, WorkerWatch, decide, worker_restarts
from deploy.redis_supervisor import RedisSpec, RedisSupervisor
from deploy.scale import ScaleTarget, scale
from deploy.state import with_secrets, without_secrets
from serving.registry import CONTROLLER_REPORT_KEY, WorkerRegistry

log = logging.getLogger(__name__)
DESIRED_KEY = "desired"
REPORT_KEY = CONTROLLER_REPORT_KEY


def probe_actor(name: str, timeout_s: float) -> tuple[Probe, str]:
    """Ask the actor ``name`` (a worker's or a router's) how it is; returns the probe and a detail
    (a start error's last line).

    Only an actor whose name Ray no longer knows is ``DEAD`` (Ray frees the name of an actor
    that will not come back); a call that fails or times out means ``UNRESPONSIVE``: Ray
    raises ``ActorUnavailableError`` / ``ActorDiedError`` for calls to a paused or restarting
    actor too.
    """
    try:
        actor = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return Probe.DEAD, "no such actor"
    try:
        st = ray.get(actor.status.remote(), timeout=timeout_s)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as e:
        return Probe.UNRESPONSIVE, type(e).__name__
    lines = st["error"].strip().splitlines()
    return Probe(st["phase"]), lines[-1] if lines else ""


@ray.remote(max_restarts=-1, max_task_retries=0, max_concurrency=4)
class ControllerActor:
    """See the module docstring. ``state`` is the cluster state ``up`` built (workers,
    placement groups, template, shape, ``num_routers``); ``redis`` is given where ``up`` started
    the Redis; ``router`` is the routers' config (:class:`router.server.RouterConfig`; ``None``:
    routers are not recreated). Ray gives a restarted controller the same arguments."""

    def __init__(self, state: dict, heal: HealConfig, redis: RedisSpec | None, router=None) -> None:
        worker_config_from_dict(state["worker_template"]).log.apply()  # the cluster's --log-format / --log-level
        self.cfg = heal
        self.reg = WorkerRegistry(state["redis_url"], state["cluster"])
        self.state = state
        if was_restarted():
            self.state = self._stored_state() or state
            log.warning("controller restarted; desired state of %d workers", len(self.state["workers"]))
        self.redis = RedisSupervisor(redis, heal.redis_down_checks, heal.redis_ping_timeout_s) if redis else None
        self.router_cfg = router
        self.router_watches: dict[int, WorkerWatch] = {}
        self.watches: dict[str, WorkerWatch] = {}
        self.report_now: dict = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._persist()
        threading.Thread(target=self._run, name="controller", daemon=True).start()

    def _stored_state(self) -> dict | None:
        """The desired state saved in Redis, with the secrets of the one Ray gave again put back."""
        try:
            stored = self.reg.get_state(DESIRED_KEY)
            return with_secrets(stored, self.state) if stored else None
        except RedisError as e:
            log.warning("desired state not readable from Redis (%s); using the one from `up`", e)
            return None

    def _persist(self) -> None:
        try:
            self.reg.put_state(DESIRED_KEY, without_secrets(self.state))  # anyone with the Redis password reads it
        except RedisError as e:
            log.warning("desired state not saved to Redis (%s); saved on the next change", e)

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.period_s):
            try:
                self.reconcile()
            except Exception:  # noqa: BLE001 - the loop must survive anything
                log.exception("reconcile failed")

    def reconcile(self) -> dict:
        """One pass: Redis, then every desired worker; returns the report it published."""
        with self._lock:
            redis_up = self.redis.check() if self.redis else True
            live: dict = {}
            routers: set[int] = set()
            if redis_up:
                try:
                    live = {info.worker_id: info for info, _ in self.reg.live_workers()}
                    routers = {r.index for r in self.reg.live_routers()}
                except RedisError:
                    redis_up = False
            if redis_up:
                self._heal(live)
                self._heal_routers(routers)
            self.report_now = self._report(redis_up, live, routers)
            if redis_up:
                try:
                    self.reg.put_state(REPORT_KEY, self.report_now, ttl_s=max(10.0, 5 * self.cfg.period_s))
                except RedisError:
                    pass
            return self.report_now

    def _heal(self, live: dict) -> None:
        changed = False
        for entry in self.state["workers"]:
            wid = entry["worker_id"]
            watch = self.watches.setdefault(wid, WorkerWatch(wid, entry["role"]))
            if "first_generation" not in entry and "generation" in entry:  # restarts count from it
                entry["first_generation"] = entry["generation"]
                changed = True
            info = live.get(wid)
            if info is not None:
                watch.seen_live()
                if entry.get("address") != info.address or entry.get("pid") != info.pid:
                    entry.update(address=info.address, pid=info.pid, generation=info.generation)
                    changed = True
                continue
            probe, detail = probe_actor(entry["actor"], self.cfg.probe_timeout_s)
            now = time.monotonic()  # after the probe, which may take probe_timeout_s
            action = decide(watch, probe, now, self.cfg, detail)
            if action is not Action.NONE:
                self._act(entry, watch, action, now)
        if changed:
            self._persist()

    def _heal_routers(self, live: set[int]) -> None:
        """Keep every desired router: one missing from Redis is probed through its actor and
        healed by the workers' rules (:func:`deploy.heal.decide`): Ray restarts a crashed one by
        itself; a hung or paused one (its record expired, its actor does not answer) is killed
        with restart after ``hung_after_s``, on the same shared ports; one whose actor Ray no
        longer knows is created again (at most once per ``restart_backoff_s``)."""
        if self.router_cfg is None:
            return
        cluster = self.state["cluster"]
        for index in range(self.state.get("num_routers", 1)):
            watch = self.router_watches.setdefault(index, WorkerWatch(f"router-{index}", "router"))
            if index in live:
                watch.seen_live()
                continue
            name = router_actor_name(cluster, index)
            probe, detail = probe_actor(name, self.cfg.probe_timeout_s)
            now = time.monotonic()
            action = decide(watch, probe, now, self.cfg, detail)
            if action is Action.NONE or (action is Action.RECREATE and
                                         now - watch.acted_at < self.cfg.restart_backoff_s):
                continue
            log.warning("router-%d missing from the registry (%s): %s", index, watch.reason, action.value)
            try:
                if action is Action.RESTART:
                    ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=False)
                else:
                    create_router_actor(cluster, replace(self.router_cfg, index=index), follow=True)
            except Exception as e:  # noqa: BLE001 - retried next period
                log.error("%s of router-%d failed: %s", action.value, index, e)
            watch.acted_at = now
            watch.restarts += 1

    def _act(self, entry: dict, watch: WorkerWatch, action: Action, now: float) -> None:
        wid = entry["worker_id"]
        log.warning("worker %s missing from the registry (%s): %s", wid, watch.reason, action.value)
        try:
            if action is Action.RESTART:
                ray.kill(ray.get_actor(entry["actor"], namespace=NAMESPACE), no_restart=False)
            else:
                recreate_worker(self.state, entry)
        except Exception as e:  # noqa: BLE001 - retried next period
            log.error("%s of worker %s failed: %s", action.value, wid, e)
        watch.acted_at = now
        watch.restarts += 1

    def _report(self, redis_up: bool, live: dict, routers: set[int]) -> dict:
        desired = {role: sum(w["role"] == role for w in self.state["workers"]) for role in WORKER_ROLES}
        workers = []
        for entry in self.state["workers"]:
            watch = self.watches.get(entry["worker_id"])
            workers.append({"worker_id": entry["worker_id"], "role": entry["role"],
                            "live": entry["worker_id"] in live if redis_up else None,
                            "reason": watch.reason if watch else "", "restarts": worker_restarts(entry, watch)})
        return {"updated_at": time.time(), "desired": desired, "workers": workers, "redis_up": redis_up,
                "redis_restarts": self.redis.restarts if self.redis else 0,
                "routers": {"desired": self.state.get("num_routers", 1), "live": sorted(routers),
                            "missing": {str(i): {"reason": w.reason, "restarts": w.restarts}
                                        for i, w in self.router_watches.items() if i not in routers}}}

    def report(self) -> dict:
        """The last report (as published to Redis)."""
        return self.report_now

    def desired_state(self) -> dict:
        """The desired state (the cluster state the state file mirrors)."""
        with self._lock:
            return self.state

    def scale(self, target: dict, wait_s: float = 300.0) -> dict:
        """Heal, then bring the desired workers to ``target`` (the fields of
        :class:`deploy.scale.ScaleTarget`) and wait up to ``wait_s`` seconds until every desired
        worker is live. Returns the new state; ``state["last_scale"]`` also holds ``live``
        (live workers per role when it returned).

        Raises:
            ValueError / PlacementError / RuntimeError: see :func:`deploy.scale.scale`.
        """
        with self._lock:
            self.reconcile()
            self.state = scale(self.state, ScaleTarget(**target))
            self._persist()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            report = self.reconcile()
            if all(w["live"] for w in report["workers"]):
                break
            time.sleep(self.cfg.period_s)
        live = {role: sum(bool(w["live"]) and w["role"] == role for w in self.report_now["workers"])
                for role in WORKER_ROLES}
        with self._lock:
            self.state["last_scale"]["live"] = live
            return self.state

    def stop(self) -> None:
        self._stop.set()


def start_controller(state: dict, heal: HealConfig, redis: RedisSpec | None, router=None):
    """Create the cluster's controller actor on the head node; returns its handle (``router``:
    the routers' config, to recreate a router that is gone for good)."""
    return ControllerActor.options(
        name=actor_name(state["cluster"], "controller"), namespace=NAMESPACE, lifetime="detached", num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(head_node_id(), soft=False),
    ).remote(state, heal, redis, router)


def controller_of(cluster: str):
    """The controller actor of ``cluster``.

    Raises:
        RuntimeError: the cluster has no controller (started by an older pdcluster).
    """
    try:
        return ray.get_actor(actor_name(cluster, "controller"), namespace=NAMESPACE)
    except ValueError:
        raise RuntimeError(f"cluster {cluster!r} has no controller (started by an older pdcluster?): "
                           "bring it up again (`pdcluster down`, `pdcluster up`)") from None


__all__ = ["ControllerActor", "HealConfig", "RedisSpec", "start_controller", "controller_of"]
