"""The process's open-file limit, raised to fit the connections its ports may hold.

Every port bounds its connections (gRPC: :func:`serving.rpc.connection_options`; HTTP:
:mod:`router.http_protocol`, :mod:`router.tls_gate`), and the process's soft ``RLIMIT_NOFILE``
must fit those bounds plus what the process needs besides, or a flood of connections would use
up the descriptors its other sockets, files and logs need.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)

FD_HEADROOM = 1024
"""Open files a process keeps for everything but its ports' connections (Redis, files, logs, outgoing channels)."""


def make_fd_room(max_connections: int) -> None:
    """Raise this process's soft open-file limit (``RLIMIT_NOFILE``) to ``max_connections`` (all
    its ports' bounds together) + :data:`FD_HEADROOM` when it is lower, as far as the hard limit
    allows (logs a warning when that is not enough: a flood of connections could then exhaust the
    process's descriptors)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + FD_HEADROOM
    if soft >= want or soft == resource.RLIM_INFINITY:
        return
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    if new < want:
        log.warning("open-file limit %d (hard) is below the ports' connection limits (%d) + %d: lower them "
                    "(pdcluster up --http-max-connections, --grpc-max-connections) or raise the limit (ulimit -n)",
                    hard, max_connections, FD_HEADROOM)
