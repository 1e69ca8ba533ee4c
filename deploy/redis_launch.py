"""``python -m deploy.redis_launch WORKDIR TIMEOUT_S`` (the URL on stdin): start a cluster Redis detached,
print its pid, exit.

The cluster controller's Redis supervisor (:mod:`deploy.redis_supervisor`) starts a replacement
server through this short-lived launcher, so the server is not the controller's child: when a
Ray worker process exits, Ray kills its child processes (``RAY_kill_child_processes_on_worker_exit``,
a new session does not escape it), and the cluster's Redis must outlive the controller actor (a
clean exit or one that Ray does not restart). Once the launcher has exited, the server is
reparented to init, like the one ``pdcluster up`` started.

Exit status 0 with the server's pid on stdout once it answers PING and ``INFO server`` names its
pid; 1 with the reason on stderr (one line, without the password) when it exited or did not answer
within ``TIMEOUT_S``. The URL comes on stdin because it holds the password: a command line is readable
by every local user.
"""

from __future__ import annotations

import sys

from deploy.redis_supervisor import RedisSpec


def main(argv: list[str], url: str) -> int:
    workdir, timeout_s = argv[0], float(argv[1])
    server = RedisSpec(url.strip(), workdir).server()
    try:
        server.start(timeout_s=timeout_s)  # reaps a server that exits or never answers
    except (RuntimeError, OSError) as e:
        line = str(e).splitlines()[0]
        print(line.replace(server.password, "***") if server.password else line, file=sys.stderr)
        return 1
    print(server.pid, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], sys.stdin.read()))
