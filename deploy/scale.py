"""``pdcluster scale``: add or remove workers while the cluster serves.

Added workers go into a new placement group (one per ``scale`` call, the
strategy, pinning and per-worker resources ``up`` recorded) and serve as soon
as they registered. Removed workers are the newest of their role; each first
drains (:meth:`serving.worker_host.WorkerHost.drain`: the router stops
sending it requests, it finishes the ones it has, then deregisters), and only
then is stopped and its actor killed, so nothing in flight is lost. A placement
group whose workers are all gone is removed. Workers are added before any is
removed, so capacity never dips below the smaller of the two sizes.

The state file is rewritten after every change; an exclusive lock
(``<state-dir>/scale.lock``) keeps two ``scale`` calls from interleaving.
"""

from __future__ import annotations

import fcntl
import json
import logging
import sys
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import ray
from redis.exceptions import RedisError

from common.model_config import FieldError
from deploy.cluster import (
    NAMESPACE,
    WORKER_ROLES,
    actor_name,
    kill_actors,
    remove_groups,
    start_workers,
    worker_config_from_dict,
)
from deploy.placement import PlacementConfig, WorkerShape
from deploy.ray_env import check_ray_reachable
from deploy.state import DEFAULT_STATE_DIR, no_cluster_text, read_state, write_state

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScaleTarget:
    """Wanted worker counts; ``None`` keeps a role as it is.

    Attributes:
        prefill / decode / colocated: wanted counts.
        drain_timeout_s: seconds a removed worker may take to finish its requests;
            after that it is stopped anyway (its remaining requests fail).
        start_timeout_s: seconds to wait for added workers to load and register.
        placement_timeout_s: seconds to wait for Ray to place added workers
            (``None``: the one ``up`` used).

    Raises:
        common.model_config.FieldError: a negative count or a non-positive timeout (naming
            the field: ``cmd_scale`` names the flag instead).
    """

    prefill: int | None = None
    decode: int | None = None
    colocated: int | None = None
    drain_timeout_s: float = 600.0
    start_timeout_s: float = 300.0
    placement_timeout_s: float | None = None

    def __post_init__(self) -> None:
        for role in WORKER_ROLES:
            n = getattr(self, role)
            if n is not None and n < 0:
                raise FieldError(role, "must be >= 0", n)
        for name in ("drain_timeout_s", "start_timeout_s", "placement_timeout_s"):
            t = getattr(self, name)
            if t is not None and not t > 0:
                raise FieldError(name, "must be > 0", t)


def plan(state: dict, target: ScaleTarget) -> tuple[list[tuple[str, str]], list[dict]]:
    """What to change: ``(workers to add as (role, id), state entries of workers to remove)``.

    Removed workers are the newest (highest index) of their role; new ids continue
    the role's index sequence (``state["next_index"]``).

    Raises:
        ValueError: the result would leave no way to serve (a disaggregated cluster
            needs >= 1 prefill and >= 1 decode worker, a colocated one >= 1
            colocated worker), or it mixes colocated and disaggregated workers.
    """
    current = {role: [w for w in state["workers"] if w["role"] == role] for role in WORKER_ROLES}
    wanted = {role: len(current[role]) if getattr(target, role) is None else getattr(target, role)
              for role in WORKER_ROLES}
    if current["colocated"]:
        if wanted["prefill"] or wanted["decode"]:
            raise ValueError("this cluster is colocated: scale it with --workers (--prefill and --decode are for a "
                             "disaggregated one)")
        if wanted["colocated"] < 1:
            raise ValueError(f"a colocated cluster needs >= 1 colocated worker; asked for {wanted['colocated']}")
    elif wanted["colocated"]:
        raise ValueError("this cluster is disaggregated: scale it with --prefill and --decode (--workers is for a "
                         "colocated one, `pdcluster up --colocated`)")
    elif wanted["prefill"] < 1 or wanted["decode"] < 1:
        raise ValueError(f"need at least one prefill and one decode worker; asked for {wanted['prefill']} prefill "
                         f"and {wanted['decode']} decode")
    add: list[tuple[str, str]] = []
    remove: list[dict] = []
    next_index = dict(state.get("next_index", {}))
    for role in WORKER_ROLES:
        have = sorted(current[role], key=lambda w: int(w["worker_id"].rsplit("-", 1)[1]))
        for _ in range(wanted[role] - len(have)):
            i = next_index.get(role, len(have))
            add.append((role, f"{role}-{i}"))
            next_index[role] = i + 1
        if wanted[role] < len(have):
            remove.extend(reversed(have[wanted[role]:]))
    return add, remove


def scale(state: dict, target: ScaleTarget, on_change=None) -> dict:
    """Bring the running cluster described by ``state`` to ``target`` (Ray must be
    initialized, in the ``pdcluster`` namespace or any); returns the new state.

    Args:
        state: the state ``up`` (or a previous ``scale``) wrote.
        target: wanted counts and timeouts.
        on_change: ``f(state)`` called after workers were added and again after they
            were removed (e.g. to write the state file).

    Returns:
        The new state; ``state["last_scale"]`` holds the added ids and each removed
        worker's drain summary.

    Raises:
        ValueError: see :func:`plan`.
        deploy.placement.PlacementError: the added workers could not be placed (nothing
            changed then).
        RuntimeError: an added worker failed to start (nothing changed then).
    """
    if "worker_template" not in state:
        raise RuntimeError("this cluster was started by a pdcluster without scaling support; "
                           "bring it up again (`pdcluster down`, `pdcluster up`) to scale it")
    add, remove = plan(state, target)
    state = json.loads(json.dumps(state))  # a copy
    report: dict = {"added": [wid for _, wid in add], "removed": {}}
    if add:
        placement = PlacementConfig(**state["placement"])
        if target.placement_timeout_s is not None:
            placement = replace(placement, timeout_s=target.placement_timeout_s)
        pg_name = actor_name(state["cluster"], f"pg-{state.get('next_pg', 1)}")
        template = worker_config_from_dict(state["worker_template"])
        infos = start_workers(state["cluster"], template, WorkerShape(**state["shape"]), placement, add, pg_name,
                              target.start_timeout_s)
        state["workers"].extend(infos)
        state["placement_groups"].append(pg_name)
        state["next_pg"] = state.get("next_pg", 1) + 1
        next_index = state.setdefault("next_index", {})
        for role, wid in add:
            next_index[role] = max(next_index.get(role, 0), int(wid.rsplit("-", 1)[1]) + 1)
        if on_change:
            on_change(state)
    if remove:
        report["removed"] = drain(remove, target.drain_timeout_s)
        kill_actors([w["actor"] for w in remove])
        gone = {w["worker_id"] for w in remove}
        state["workers"] = [w for w in state["workers"] if w["worker_id"] not in gone]
        used = {w.get("placement_group") for w in state["workers"]}
        empty = [g for g in state["placement_groups"] if g not in used]
        remove_groups(empty)
        state["placement_groups"] = [g for g in state["placement_groups"] if g in used]
    state["last_scale"] = report
    if on_change:
        on_change(state)
    return state


def drain(workers: list[dict], timeout_s: float) -> dict[str, dict]:
    """Drain ``workers`` (state entries) concurrently; returns each one's drain summary
    (``{"drained": False, "error": ...}`` for a worker whose actor failed or is gone)."""
    refs = {}
    for w in workers:
        try:
            refs[w["worker_id"]] = ray.get_actor(w["actor"], namespace=NAMESPACE).drain.remote(timeout_s)
        except ValueError:
            refs[w["worker_id"]] = None
    out: dict[str, dict] = {}
    for wid, ref in refs.items():
        if ref is None:
            out[wid] = {"drained": False, "error": "actor not found"}
            continue
        try:
            out[wid] = ray.get(ref, timeout=timeout_s + 30)
        except Exception as e:  # noqa: BLE001 - reported; the worker is stopped anyway
            out[wid] = {"drained": False, "error": f"{type(e).__name__}: {e}"}
    return out


@contextmanager
def _scale_lock(state_dir: Path):
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / "scale.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"another `pdcluster scale` is running on {state_dir}") from None
        yield


def scale_from_state_dir(state_dir: Path | str | None, target: ScaleTarget) -> dict:
    """Read the state file, connect to the cluster's Ray, have its controller scale
    (:meth:`deploy.controller.ControllerActor.scale`: heal, change, wait until live), rewrite
    the state file.

    For a cluster whose Ray head ``up`` started here, the caller must have called
    :func:`deploy.ray_env.use_loopback_ray` before ``ray`` was imported (the CLI does).

    Raises:
        FileNotFoundError: no cluster is up under ``state_dir``.
        ConnectionError: the cluster's Ray head cannot be reached.
        RuntimeError: another ``scale`` holds the lock, the cluster has no controller or it
            stopped meanwhile; or see :func:`scale`.
    """
    from deploy.controller import controller_of

    state_dir = Path(state_dir or DEFAULT_STATE_DIR).expanduser()
    with _scale_lock(state_dir):
        state = read_state(state_dir)
        plan(state, target)  # an impossible mix is refused here, before Ray is reached
        check_ray_reachable(state["ray_address"])
        ray.init(address=state["ray_address"], namespace=NAMESPACE, logging_level="WARNING")
        try:
            controller = controller_of(state["cluster"])
            new = ray.get(controller.scale.remote(asdict(target), target.start_timeout_s))
        except ray.exceptions.RayTaskError as e:  # the controller's own error, without Ray's wrapping
            raise (e.cause if isinstance(e.cause, Exception) else RuntimeError(str(e))) from None
        except ray.exceptions.ActorDiedError:  # e.g. `pdcluster down` meanwhile
            raise RuntimeError("the cluster's controller stopped during the scale (was `pdcluster down` run?); "
                               "see `pdcluster status`") from None
        except ray.exceptions.RayActorError as e:  # unavailable: paused, hung, or restarting
            raise RuntimeError(f"the cluster's controller stopped answering during the scale (hung, or restarting: "
                               f"{type(e).__name__}); see `pdcluster status`") from None
        finally:
            ray.shutdown()
        write_state(state_dir, {**state, **new})
        return new


def _drain_failure(summary: dict) -> str:
    """Why a removed worker's drain did not finish, in words (``summary``: :func:`drain`'s entry)."""
    if summary.get("error"):
        return f"its drain failed ({summary['error'].splitlines()[0][:200]}): it died or stopped answering"
    left = ", ".join(f"{summary.get(k, 0)} {k.removeprefix('num_').replace('_', ' ')}"
                     for k in ("num_running", "num_waiting", "active_rpcs"))
    return f"--drain-timeout-s ran out after {summary.get('waited_s', 0):.1f} s with {left}"


_FLAGS = {"prefill": "--prefill", "decode": "--decode", "colocated": "--workers",
          "drain_timeout_s": "--drain-timeout-s", "start_timeout_s": "--timeout-s",
          "placement_timeout_s": "--placement-timeout-s"}
"""The ``scale`` flag that sets each :class:`ScaleTarget` field (its errors name the flag)."""


def cmd_scale(args) -> int:
    """``pdcluster scale``; returns 0, or 1 when no cluster is up, the change is refused or could not
    be placed (nothing changed then), or a removed worker did not drain in time, or 2 when a flag
    is out of range (messages on stderr: one line each)."""
    try:
        target = ScaleTarget(prefill=args.prefill, decode=args.decode, colocated=args.workers,
                             drain_timeout_s=args.drain_timeout_s, start_timeout_s=args.timeout_s,
                             placement_timeout_s=args.placement_timeout_s)
    except FieldError as e:
        print(f"pdcluster scale: error: {e.renamed(_FLAGS)}", file=sys.stderr)
        return 2
    try:
        state = scale_from_state_dir(args.state_dir, target)
    except FileNotFoundError:
        print(no_cluster_text(args.state_dir), file=sys.stderr)
        return 1
    except (ValueError, RuntimeError, ConnectionError) as e:  # bad counts, placement failure, busy lock, no Ray
        print(f"error: {e}", file=sys.stderr)
        return 1
    except RedisError as e:  # the controller's, e.g. Redis down for longer than a worker waits to register
        print(f"error: the cluster's Redis failed during the scale ({e}); see `pdcluster status`", file=sys.stderr)
        return 1
    report = state["last_scale"]
    counts = {role: sum(w["role"] == role for w in state["workers"]) for role in WORKER_ROLES}
    live = report.get("live", counts)
    print(f"pdcluster scaled: {', '.join(f'{live[r]}/{n} {r}' for r, n in counts.items() if n)} live; "
          f"added {report['added'] or 'none'}; removed {sorted(report['removed']) or 'none'}")
    late = {wid: r for wid, r in report["removed"].items() if not r.get("drained")}
    for wid, r in late.items():
        print(f"warning: {wid} was stopped before it drained: {_drain_failure(r)}", file=sys.stderr)
    short = {r: n - live.get(r, 0) for r, n in counts.items() if live.get(r, 0) < n}
    if short:
        print(f"warning: not every desired worker is live yet ({short} missing); see `pdcluster status`",
              file=sys.stderr)
    return 1 if late or short else 0
