"""``deploy.ray_node.start_ray_head``: a head one of whose components cannot bind its port is started
again on other ports (seen in the suite: the Ray client server's port taken, ``ray start --block``
killed the head a second after ``Ray runtime started``, and ``up``, already connected, waited on the
dead GCS for good); ``deploy.ray_watch``: a head that dies while ``up`` starts the cluster ends ``up``
at once, with what it started stopped."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import pytest
import ray
from cluster_utils import children, live_session_members

from deploy import ray_node
from deploy.ray_env import ray_answers
from deploy.ray_watch import HeadWatch
from deploy.redis_control import pid_alive
from deploy.state import state_path


def test_a_head_whose_client_server_port_is_taken_is_started_again(tmp_path, monkeypatch, capsys):
    taken = socket.socket()  # listening without SO_REUSEPORT: the client server's bind fails
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    drawn: list[list[int]] = []
    real = ray_node.ray_node_ports

    def ports(count: int = 3) -> list[int]:
        got = real(count)
        if not drawn:
            got[1] = taken.getsockname()[1]  # gcs, client server, dashboard agent
        drawn.append(got)
        return got

    monkeypatch.setattr(ray_node, "ray_node_ports", ports)
    try:
        address, pid = ray_node.start_ray_head(tmp_path)
    finally:
        taken.close()
    try:
        assert len(drawn) == 2 and address == f"127.0.0.1:{drawn[1][0]}"
        assert "starting it again on other ports" in capsys.readouterr().err
        ray.init(address=address, logging_level="WARNING")
        try:
            assert ray.cluster_resources()["CPU"] >= 1  # the second head serves
        finally:
            ray.shutdown()
    finally:
        ray_node.stop_ray_head(pid)


def test_head_watch_calls_on_lost_once_after_the_misses_in_a_row():
    answers = iter([True, False, True, False, False, False, False])
    lost = threading.Event()
    calls = []
    watch = HeadWatch(lambda: next(answers, False), lambda: (calls.append(1), lost.set()), period_s=0.01, misses=2)
    with watch:
        assert lost.wait(5)
        time.sleep(0.1)
    assert calls == [1]


def test_head_watch_stopped_first_calls_nothing_and_rejects_bad_settings():
    calls = []
    with HeadWatch(lambda: True, lambda: calls.append(1), period_s=0.01):
        time.sleep(0.05)
    watch = HeadWatch(lambda: False, lambda: calls.append(1), period_s=0.05)
    watch.stop()
    watch.start()
    time.sleep(0.2)
    assert calls == []
    with pytest.raises(ValueError, match="period_s"):
        HeadWatch(lambda: True, lambda: None, period_s=0)


def test_pid_alive_sees_a_child_exit():
    child = subprocess.Popen(["sleep", "30"])
    alive = partial(pid_alive, child.pid)
    assert alive()
    child.kill()
    deadline = time.monotonic() + 5
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive()


def test_up_stops_what_it_started_when_its_head_dies_while_starting(tmp_path):
    """The head killed once ``up`` has started Redis: ``up`` says so and exits with 1 within
    seconds (Ray alone would end it 60 s later, leaving Redis running and no state file)."""
    state_dir = tmp_path / "state"
    up = subprocess.Popen([sys.executable, "-m", "pdcluster.cli", "up", "--local", "--port", "0", "--http-port", "0",
                           "--state-dir", str(state_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, logs = time.monotonic() + 120, []
        while not logs and up.poll() is None and time.monotonic() < deadline:
            logs = list((state_dir / "redis").glob("redis-*.log"))
            time.sleep(0.1)
        assert logs, f"up did not start Redis: {up.poll()}"
        redis_port = int(logs[0].stem.removeprefix("redis-"))
        heads = [pid for pid in children(up.pid) if "ray" in Path(f"/proc/{pid}/cmdline").read_text()]
        assert len(heads) == 1, heads
        os.killpg(heads[0], signal.SIGKILL)  # the whole head: GCS, raylet and the `ray start` watching them
        killed_at = time.monotonic()
        out, err = up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 1, (out, err)
    assert time.monotonic() - killed_at < 20
    assert "the Ray head at 127.0.0.1:" in err and "while `up` was starting the cluster" in err, err
    assert not state_path(state_dir).exists() and not (state_dir / "redis").exists()
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", redis_port)) != 0, "up left its Redis running"
    assert not live_session_members(heads[0]), "up left processes of the head's session running"


def test_ray_answers_probes_the_address():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        address = f"127.0.0.1:{listening.getsockname()[1]}"
        assert ray_answers(address, timeout_s=1.0)
    assert not ray_answers(address, timeout_s=1.0)
