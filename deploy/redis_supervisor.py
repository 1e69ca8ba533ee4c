"""Keeping a local cluster's Redis up: restart it on the same port, password and folder.

The server ``pdcluster up`` starts keeps an append-only file (``persist``), so a restarted
one comes back with the registry, the desired state and the workers' generation counters;
workers re-register within two heartbeats anyway (:class:`serving.heartbeat.Heartbeater`),
and the router serves from its last view meanwhile (:class:`serving.discovery.RegistryView`).

Failure contract (:class:`RedisSupervisor`): after ``down_checks`` consecutive PINGs without a
PONG within ``ping_timeout_s`` (both in :class:`deploy.heal.HealConfig`) the server is either
dead or hung (alive, not answering: paused, stuck). A hung one is killed (SIGKILL; its process
is found by pid: the one ``up`` started, the last one that answered ``INFO server``, the
replacement the supervisor started, else the redis/valkey process whose title names the port)
and reaped when it is the child of this process (the one ``up`` started, in tests); the
replacement is started only once the port is free, and counts as restarted only when it still
runs and ``INFO server`` names its pid.
A replacement is started through a launcher that exits (:mod:`deploy.redis_launch`), so it is
never the supervisor's child: it outlives the controller actor (Ray kills an exiting worker's
children) and init reaps it. Each fault logs one line.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import redis

from deploy.redis_control import POLL_S, pid_alive, redis_client, server_pid, wait_pid_gone
from deploy.redis_server import LocalRedisServer, port_is_free

log = logging.getLogger(__name__)

PORT_WAIT_S = 5.0  # how long a replacement waits for the killed server's port
START_TIMEOUT_S = 5.0  # how long a replacement may take to answer PING
LAUNCHER_S = 10.0  # what the launcher may take beyond that (a Python start on a loaded machine)


@dataclass(frozen=True)
class RedisSpec:
    """How the cluster's Redis was started: its URL (host, port, password), folder and the pid
    of the server ``up`` started (``None``: unknown; found by ``INFO server`` or ``/proc``)."""

    url: str
    workdir: str
    pid: int | None = None

    @property
    def host(self) -> str:
        return urlparse(self.url).hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        return int(urlparse(self.url).port)

    def server(self) -> LocalRedisServer:
        return LocalRedisServer(Path(self.workdir), port=self.port, host=self.host, detach=True,
                                password=urlparse(self.url).password or None, persist=True)

    def launch(self, timeout_s: float) -> int:
        """Start the server detached through :mod:`deploy.redis_launch` (not a child of this
        process); its pid once it answers.

        Raises:
            RuntimeError: it exited or did not answer within ``timeout_s`` (the launcher's reason).
        """
        try:  # the URL (it holds the password) on stdin: a command line is readable by every local user
            done = subprocess.run([sys.executable, "-m", "deploy.redis_launch", self.workdir, str(timeout_s)],
                                  input=self.url, capture_output=True, text=True, timeout=timeout_s + LAUNCHER_S,
                                  cwd=Path(__file__).resolve().parents[1])  # `deploy` importable, installed or not
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"its launcher did not finish within {timeout_s + LAUNCHER_S:.0f} s") from None
        if done.returncode != 0 or not done.stdout.strip().isdigit():
            raise RuntimeError(done.stderr.strip() or f"its launcher exited with code {done.returncode}")
        return int(done.stdout)


class RedisSupervisor:
    """Kills (when hung) and restarts the Redis of ``spec`` after ``down_checks`` consecutive
    PINGs that got no PONG within ``ping_timeout_s`` seconds.

    Args:
        spec: the supervised server.
        down_checks: consecutive failed checks before acting (> 0).
        ping_timeout_s: seconds one PING may take (> 0).
        port_wait_s: seconds to wait for the port to be free before starting a replacement.

    Attributes:
        restarts: how many times it restarted the server.

    Raises:
        ValueError: a non-positive ``down_checks``, ``ping_timeout_s`` or ``port_wait_s``.
    """

    def __init__(self, spec: RedisSpec, down_checks: int, ping_timeout_s: float,
                 port_wait_s: float = PORT_WAIT_S) -> None:
        for name, value in (("down_checks", down_checks), ("ping_timeout_s", ping_timeout_s),
                            ("port_wait_s", port_wait_s)):
            if value <= 0:
                raise ValueError(f"RedisSupervisor.{name} must be positive, got {value}")
        self.spec = spec
        self.down_checks = down_checks
        self.ping_timeout_s = ping_timeout_s
        self.port_wait_s = port_wait_s
        self.restarts = 0
        self._failed = 0
        self._pid = spec.pid  # the server believed to serve the port
        self._answered_error = ""  # the error the server answered the last PING with, if any

    @property
    def pid(self) -> int | None:
        """Process id of the server believed to serve the port (``None``: not known yet)."""
        return self._pid

    def check(self) -> bool:
        """PING once; after ``down_checks`` failures in a row kill the server if it still runs
        and start a new one. Returns whether Redis answers now (after any restart). Never raises."""
        health, error = _ping(self.spec.url, self.ping_timeout_s)
        if health is not False:  # True: PONG; None: alive, answered with an error (e.g. loading its data)
            if health is None and error != self._answered_error:
                log.warning("cluster Redis at %s answers PING with an error: %s", _where(self.spec.url), error)
            self._failed, self._answered_error = 0, error
            if health and self._pid is None:
                self._pid = server_pid(self.spec.url, self.ping_timeout_s)
            return bool(health)
        self._failed += 1
        if self._failed < self.down_checks:
            return False
        try:
            return self._restart(error)
        except Exception:  # noqa: BLE001 - the controller's loop must go on; logged with the cause
            log.exception("restarting cluster Redis at %s failed", _where(self.spec.url))
            return False

    def _restart(self, error: str) -> bool:
        pid = self._server_process()
        what = f"hung: killing its process (pid {pid}, SIGKILL)" if pid else "no redis/valkey process serves its port"
        log.warning("cluster Redis at %s gave no PONG within %.1f s to %d PINGs in a row (last: %s); %s; "
                    "restarting it", _where(self.spec.url), self.ping_timeout_s, self._failed, error, what)
        if pid:
            self._kill(pid)
        if not self._wait_port_free():
            log.error("cluster Redis port %d still taken %.1f s after its server stopped answering "
                      "(no redis/valkey process of this port found to kill, or it survived); not starting a new one",
                      self.spec.port, self.port_wait_s)
            return False
        try:
            new = self.spec.launch(START_TIMEOUT_S)
        except (RuntimeError, OSError) as e:
            log.error("restarting cluster Redis failed: %s", e)
            return False
        answering = server_pid(self.spec.url, self.ping_timeout_s)
        if not _serves_port(new, self.spec.port) or answering != new:
            log.error("new cluster Redis (pid %s) not serving after its PING (running: %s, INFO pid %s); killed",
                      new, pid_alive(new), answering)
            self._kill(new)
            return False
        self._pid, self._failed = new, 0
        self.restarts += 1
        log.warning("cluster Redis restarted (pid %s) on %s", new, _where(self.spec.url))
        return True

    def _server_process(self) -> int | None:
        return server_process(self.spec.port, self._pid)

    def _kill(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        except PermissionError as e:
            log.error("cannot kill cluster Redis pid %d: %s", pid, e)
        wait_pid_gone(pid, self.port_wait_s)  # reaps it if it is a child of this process
        self._pid = None

    def _wait_port_free(self) -> bool:
        deadline = time.monotonic() + self.port_wait_s
        while not port_is_free(self.spec.host, self.spec.port):
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True


def server_process(port: int, believed: int | None = None) -> int | None:
    """Pid of the live redis/valkey process of this machine serving ``port`` (``believed`` first:
    the pid thought to serve it), ``None`` if none."""
    if believed and _serves_port(believed, port):
        return believed
    return next((pid for pid in _all_pids() if pid != believed and _serves_port(pid, port)), None)


def _ping(url: str, timeout_s: float) -> tuple[bool | None, str]:
    """``(True, "")``: PONG within ``timeout_s``; ``(None, error)``: the server answered with an error
    (e.g. still loading its data: alive, not hung); ``(False, error)``: no answer (dead or hung)."""
    client = redis_client(url, timeout_s)
    try:
        return bool(client.ping()), ""
    except (redis.exceptions.BusyLoadingError, redis.exceptions.AuthenticationError,
            redis.exceptions.ResponseError) as e:
        return None, f"{type(e).__name__}: {e}"
    except redis.exceptions.RedisError as e:
        return False, f"{type(e).__name__}: {e}"
    finally:
        client.close()


def _serves_port(pid: int, port: int) -> bool:
    """Whether ``pid`` is a live redis/valkey server of ``port`` (its comm names redis/valkey and
    its command line or process title ``NAME HOST:PORT`` names the port)."""
    if not pid_alive(pid):
        return False
    try:
        name = Path(f"/proc/{pid}/comm").read_text()
        words = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").split()
    except OSError:
        return False
    if "redis" not in name and "valkey" not in name:
        return False
    return any(w.endswith(f":{port}") for w in words) or any(
        a == "--port" and b == str(port) for a, b in zip(words, words[1:]))


def _all_pids() -> list[int]:
    try:
        return [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return []


def _where(url: str) -> str:
    return url.rsplit("@", 1)[-1]
