"""The cluster's workers as Prometheus sees them through the router: live against desired, and
restarts, so an alert tells a worker that crashed (and one in a restart loop) from a scale-down.

Every router exports, from its registry view and the cluster controller's report in Redis
(:mod:`deploy.controller` publishes it every heartbeat period, with a TTL):

* ``workers_live{worker_role}``: the live workers of each role (registered, heartbeat fresh);
* ``workers_desired{worker_role}``: the workers the controller keeps, by role;
* ``worker_restarts{target_worker}``: how often each desired worker was restarted since it was
  placed: Ray's restarts after a crash (each a new generation in the registry) and the
  controller's restarts and recreations (:func:`deploy.heal.worker_restarts`); a count, exported
  as a gauge since the controller's report holds it.

Without a report (the controller is down, or the cluster was started without one) the desired
and restart series are removed: ``absent(pdcluster:workers_desired)`` alerts on a cluster that
nothing heals, ``pdcluster:workers_live < pdcluster:workers_desired`` on a missing worker and
``delta(pdcluster:worker_restarts[10m]) > 3`` on a restart loop.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from redis.exceptions import RedisError

from serving.metrics import ProcessMetrics
from serving.registry import CONTROLLER_REPORT_KEY, WORKER_ROLES, WorkerInfo, WorkerRegistry

log = logging.getLogger(__name__)


class FleetGauges:
    """Sets the router's fleet gauges from the live workers and the controller's report.

    Args:
        metrics: the router's metrics.
        live: ``() ->`` the live workers (the router's registry view).
        registry: where the controller's report is read (owned: closed by :meth:`close`).
    """

    def __init__(self, metrics: ProcessMetrics, live: Callable[[], list[WorkerInfo]],
                 registry: WorkerRegistry) -> None:
        self._m = metrics
        self._live = live
        self._reg = registry

    def update(self) -> None:
        """Refresh every gauge; while Redis does not answer, the report's gauges keep their values."""
        roles = Counter(info.role for info in self._live())
        for role in WORKER_ROLES:
            self._m.set("workers_live", roles[role], worker_role=role)
        try:
            report = self._reg.get_state(CONTROLLER_REPORT_KEY)
        except RedisError as e:
            log.debug("controller report unreadable: %s", e)
            return
        self._m.clear("worker_restarts")  # a worker scaled away leaves no series behind
        if report is None:
            self._m.clear("workers_desired")
            return
        for role in WORKER_ROLES:
            self._m.set("workers_desired", report.get("desired", {}).get(role, 0), worker_role=role)
        for w in report.get("workers", []):
            self._m.set("worker_restarts", w.get("restarts", 0), target_worker=w["worker_id"])

    def close(self) -> None:
        self._reg.close()
