"""Every ``pdcluster`` command that talks to a cluster prints one clear line (no traceback)
on stderr and exits non-zero when what it talks to is unreachable: ``status`` (Redis),
``scale`` (Ray), ``generate`` (the router's gRPC port), ``top`` (its HTTP port),
``loadtest --backend openai`` (an OpenAI-compatible server)."""

from __future__ import annotations

import json
import socket

import pytest

from pdcluster import cli


@pytest.fixture(scope="module")
def dead_address() -> str:
    """``127.0.0.1:PORT`` where nothing listens (a port just released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture()
def dead_state(tmp_path, dead_address):
    """A state directory whose cluster (Redis, Ray, router) is gone."""
    (tmp_path / "cluster.json").write_text(json.dumps({
        "redis_url": f"redis://{dead_address}/0", "cluster": "default", "router_address": dead_address,
        "router_http_address": dead_address, "ray_address": dead_address, "workers": [], "placement_groups": [],
    }))
    return tmp_path


def _one_error_line(capsys, rc: int, needle: str) -> None:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc != 0, (out, err)
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err
    assert "Traceback" not in out + err


def test_status_without_redis(dead_state, capsys):
    _one_error_line(capsys, cli.main(["status", "--state-dir", str(dead_state)]), "cannot reach the cluster's Redis")
    _one_error_line(capsys, cli.main(["status", "--json", "--state-dir", str(dead_state)]), "Connection refused")


def test_scale_without_ray(dead_state, capsys, dead_address):
    rc = cli.main(["scale", "--prefill", "2", "--state-dir", str(dead_state)])
    _one_error_line(capsys, rc, f"cannot reach the cluster's Ray at {dead_address}")


def test_generate_without_router(capsys, dead_address):
    _one_error_line(capsys, cli.main(["generate", "--address", dead_address, "hi"]), "UNAVAILABLE")


def test_generate_with_a_value_the_client_refuses(capsys, dead_address):
    # refused before any call: one line naming the parameter, exit status 2 (no traceback)
    rc = cli.main(["generate", "--address", dead_address, "--max-tokens", "-1", "hi"])
    _one_error_line(capsys, rc, "max_tokens: -1 does not fit the field")
    assert rc == 2


def test_top_without_router(capsys, dead_address):
    rc = cli.main(["top", "--address", dead_address, "--iterations", "1"])
    _one_error_line(capsys, rc, f"cannot reach the router's HTTP server at http://{dead_address}")


def test_loadtest_without_server(capsys, dead_address):
    rc = cli.main(["loadtest", "--backend", "openai", "--base-url", f"http://{dead_address}", "--workload",
                   "synthetic", "--num-requests", "2", "--no-progress", "--tokenizer", "smollm2-135m-instruct"])
    _one_error_line(capsys, rc, f"no model listed at http://{dead_address}/v1/models")
