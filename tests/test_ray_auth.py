"""Ray's token authentication of local clusters (:mod:`deploy.ray_env`): which token a process
presents, and a real cluster's head refusing a driver without it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from deploy import ray_env


@pytest.fixture
def auth_env(monkeypatch):
    """``use_loopback_ray`` edits os.environ: let monkeypatch restore what it changes."""
    for key in (*ray_env.LOOPBACK_ENV, ray_env.TOKEN_ENV):
        monkeypatch.setenv(key, os.environ.get(key, ""))
    return monkeypatch


def test_the_token_a_process_presents(auth_env):
    auth_env.delenv(ray_env.TOKEN_ENV)
    ray_env.use_loopback_ray()
    first = ray_env.ray_token()
    assert os.environ["RAY_AUTH_MODE"] == "token" and len(first) == 64  # 256 bits, hex
    ray_env.use_loopback_ray()
    assert ray_env.ray_token() == first  # a process keeps its token (Ray caches it)
    ray_env.use_loopback_ray({"started_ray": True, ray_env.STATE_TOKEN_KEY: "c" * 64})
    assert ray_env.ray_token() == "c" * 64  # a cluster's own, from its state file
    ray_env.use_loopback_ray({"started_ray": True})  # recorded before clusters had tokens: as it runs
    assert os.environ["RAY_AUTH_MODE"] == "disabled" and ray_env.ray_token() is None


def test_local_state(tmp_path):
    path = tmp_path / "cluster.json"
    assert ray_env.local_state(path) is None
    path.write_text('{"started_ray": false}')
    assert ray_env.local_state(path) is None
    path.write_text('{"started_ray": true, "ray_auth_token": "t"}')
    assert ray_env.local_state(path) == {"started_ray": True, "ray_auth_token": "t"}


_CONNECT = textwrap.dedent("""
    import sys, ray
    try:
        ray.init(address=sys.argv[1], namespace="pdcluster", logging_level="ERROR")
        print("connected", ray.is_initialized())
    except Exception as e:
        print("refused", type(e).__name__, str(e)[:200])
""")


def test_the_head_refuses_a_driver_without_the_cluster_token(tmp_path):
    """A driver of the same machine without the token (another user's process, say) cannot join the
    cluster; with the token from the state file it can (``scale`` and ``down`` do so)."""
    from cluster_utils import running_cluster

    with running_cluster(tmp_path / "state", "--max-model-len", "256", "--num-kv-blocks", "64") as state:
        token = state[ray_env.STATE_TOKEN_KEY]
        assert token and token == ray_env.ray_token()

        def connect(env: dict) -> str:
            base = {k: v for k, v in os.environ.items() if k not in (ray_env.TOKEN_ENV, "RAY_AUTH_MODE")}
            # a refused driver gives up after 3 tries of ~1 s (Ray's default is 20)
            out = subprocess.run([sys.executable, "-c", _CONNECT, state["ray_address"]], capture_output=True,
                                 text=True, timeout=120, env={**base, "RAY_gcs_server_port_wait_time_s": "3", **env})
            return out.stdout.strip() or out.stderr[-300:]

        assert connect({"RAY_AUTH_MODE": "token", ray_env.TOKEN_ENV: token}).startswith("connected True")
        assert connect({"RAY_AUTH_MODE": "token", ray_env.TOKEN_ENV: "0" * 64}).startswith("refused")
        assert connect({"RAY_AUTH_MODE": "disabled"}).startswith("refused")
