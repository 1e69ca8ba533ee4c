"""CPU scheduling priority of a worker process (Linux ``nice``).

Workers compute; the router, Redis and the cluster controller answer requests and health checks.
On a node where they share cores (a local cluster, the head node), a worker runs ``cpu_nice``
steps below them (:attr:`serving.worker_config.WorkerConfig.cpu_nice`), so that when the workers
saturate every core the router still gets the CPU at once: an overload burst is refused in
milliseconds instead of waiting behind the workers' steps. A worker alone on its cores computes
as fast as before (niceness only orders processes that compete).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

DEFAULT_WORKER_NICE = 10
"""Nice steps a worker runs below the router by default (``pdcluster up --worker-nice``)."""


def lower_cpu_priority(increment: int) -> int:
    """Lower this process' CPU priority by ``increment`` nice steps: every thread it has now (on
    Linux the nice value is per thread) and, through inheritance, every thread and child process
    it starts later. Returns the main thread's new nice value (the old one when ``increment`` is 0
    or the change is not permitted, which is logged).

    Raises:
        ValueError: ``increment`` outside ``[0, 19]``.
    """
    if not 0 <= increment <= 19:
        raise ValueError(f"increment must be in [0, 19], got {increment}")
    if increment == 0:
        return os.getpriority(os.PRIO_PROCESS, 0)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the nice value is per process
        return os.nice(increment)
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
        except (ProcessLookupError, PermissionError) as e:  # a thread that ended meanwhile / not allowed
            log.debug("could not lower the priority of thread %d: %s", tid, e)
    return os.getpriority(os.PRIO_PROCESS, 0)
