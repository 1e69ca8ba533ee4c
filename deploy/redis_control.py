"""Talking to and stopping a local Redis server by URL or pid.

:func:`is_answering` PINGs a server, :func:`server_pid` asks its process id; :func:`stop_redis_at` shuts one down by
URL or pid (``pdcluster down``), including a detached server started by
:class:`deploy.redis_server.LocalRedisServer` in an earlier process. The table
of detached servers started by this process lives here: LocalRedisServer adds
to it, :func:`stop_redis_at` reaps from it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import urlparse

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

POLL_S = 0.05
"""Seconds between checks while waiting for a server or a process (start, exit, a free port)."""

# Detached servers started by this process, by pid: their Popen objects are
# kept here (not on the LocalRedisServer, which may be dropped while the server
# runs on) so that stop_redis_at can reap them once they exit.
DETACHED: dict[int, subprocess.Popen] = {}
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def redis_client(url: str, timeout_s: float) -> redis.Redis:
    """A client of ``url`` whose connect and every command give up after ``timeout_s`` seconds, no retries."""
    return redis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )


def is_answering(url: str, timeout_s: float = 0.5) -> bool:
    """Whether a Redis server at ``url`` answers PING within ``timeout_s`` seconds."""
    client = redis_client(url, timeout_s)
    try:
        return bool(client.ping())
    except redis.exceptions.RedisError:
        return False
    finally:
        client.close()


def server_pid(url: str, timeout_s: float = 0.5) -> int | None:
    """Process id of the Redis server answering at ``url`` (``INFO server``), ``None`` when none
    answers within ``timeout_s`` seconds (or it refuses INFO, e.g. still loading its data)."""
    client = redis_client(url, timeout_s)
    try:
        return int(client.info("server").get("process_id", 0)) or None
    except (redis.exceptions.RedisError, ValueError):
        return None
    finally:
        client.close()


def is_zombie(pid: int) -> bool:
    """Whether ``pid`` has exited but not been reaped yet (state ``Z`` in ``/proc/PID/stat``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[:1] == ["Z"]


def send_shutdown(url: str, timeout_s: float) -> None:
    """SHUTDOWN NOSAVE; a server that is already gone is not an error."""
    client = redis_client(url, timeout_s)
    try:
        client.shutdown(nosave=True)
    except redis.exceptions.RedisError:
        pass
    finally:
        client.close()


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (reaping it when it is an exited child of this process;
    a zombie of another parent counts as gone)."""
    proc = DETACHED.get(pid)
    if proc is not None:
        if proc.poll() is None:
            return True
        DETACHED.pop(pid, None)
        return False
    try:
        reaped, _ = os.waitpid(pid, os.WNOHANG)  # reaps it if it is our child
        if reaped == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not is_zombie(pid)  # exited, waiting for a parent that is not this process


def wait_pid_gone(pid: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` seconds for process ``pid`` to be gone (:func:`pid_alive`); whether it is."""
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def _check_is_redis(pid: int) -> None:
    comm = Path(f"/proc/{pid}/comm")
    try:
        name = comm.read_text().strip()
    except OSError:
        return  # gone already, or no /proc on this system
    if "redis" not in name and "valkey" not in name:
        raise ValueError(f"pid {pid} is {name!r}, not a redis/valkey server")


def stop_redis_at(url_or_pid: str | int, timeout_s: float = 5.0) -> bool:
    """Shut down a (typically detached) Redis server by URL or pid.

    With a URL: reads the server's pid (INFO), sends SHUTDOWN NOSAVE and waits
    until it no longer answers; if it still answers after ``timeout_s`` and
    runs on this machine, it is killed. With a pid: SIGTERM (the server exits
    without saving since persistence is disabled), then SIGKILL after
    ``timeout_s``.

    Args:
        url_or_pid: ``redis://host:port/db`` URL, or a process id (int or digits).
        timeout_s: seconds to wait for a clean exit before killing.

    Returns:
        ``True`` if a server was shut down, ``False`` if none was running there.

    Raises:
        ValueError: a pid that does not belong to a redis/valkey process.
        RuntimeError: a server on another machine still answers ``timeout_s``
            after SHUTDOWN NOSAVE (it cannot be killed from here).
        redis.exceptions.RedisError: the server refused INFO (e.g. needs a password).
    """
    _reap_detached()  # servers of this process that exited meanwhile (e.g. killed by a supervisor)
    if isinstance(url_or_pid, int) or str(url_or_pid).isdigit():
        return _stop_pid(int(url_or_pid), timeout_s)
    return _stop_url(str(url_or_pid), timeout_s)


def _reap_detached() -> None:
    for pid, proc in list(DETACHED.items()):
        if proc.poll() is not None:
            DETACHED.pop(pid, None)


def _stop_pid(pid: int, timeout_s: float) -> bool:
    if not pid_alive(pid):
        return False
    _check_is_redis(pid)
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    if not wait_pid_gone(pid, timeout_s):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        wait_pid_gone(pid, timeout_s)
    return True


def _stop_url(url: str, timeout_s: float) -> bool:
    client = redis_client(url, min(timeout_s, 2.0))
    try:
        pid = int(client.info("server").get("process_id", 0)) or None
    except redis.exceptions.ConnectionError:
        return False
    finally:
        client.close()
    send_shutdown(url, timeout_s=min(timeout_s, 2.0))
    local = (urlparse(url).hostname or "") in _LOOPBACK_HOSTS
    deadline = time.monotonic() + timeout_s
    while is_answering(url, timeout_s=0.5):
        if time.monotonic() >= deadline:
            if pid is not None and local:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                break
            raise RuntimeError(f"redis at {url} still answers {timeout_s:.1f} s after SHUTDOWN NOSAVE")
        time.sleep(POLL_S)
    if pid is not None and local:
        wait_pid_gone(pid, timeout_s)
    return True
