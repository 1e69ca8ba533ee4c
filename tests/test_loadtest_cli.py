"""``pdcluster loadtest`` finds its target in the cluster state ``pdcluster up`` wrote when no
``--address`` / ``--base-url`` is given, and says which flag to give when none is up."""

from __future__ import annotations

import pytest

from deploy.state import write_state
from loadtest.cli import configs_from_args
from pdcluster import cli


def _run(*argv: str):
    return configs_from_args(cli.build_parser().parse_args(["loadtest", "--workload", "synthetic", *argv]))[1]


def test_the_target_comes_from_the_state_dir(tmp_path):
    write_state(tmp_path, {"router_address": "127.0.0.1:6001", "router_http_address": "127.0.0.1:6002"})
    assert _run("--state-dir", str(tmp_path)).address == "127.0.0.1:6001"
    assert _run("--state-dir", str(tmp_path), "--backend", "openai").address == "http://127.0.0.1:6002"
    assert _run("--state-dir", str(tmp_path), "--backend", "openai", "--tls-ca", "ca.pem").address == \
        "https://127.0.0.1:6002"
    assert _run("--state-dir", str(tmp_path), "--address", "10.0.0.1:1").address == "10.0.0.1:1"  # the flag wins


def test_no_cluster_in_the_state_dir_names_the_flag(tmp_path):
    with pytest.raises(ValueError, match=f"no pdcluster is up from state dir {tmp_path}; give --address"):
        _run("--state-dir", str(tmp_path))
    with pytest.raises(ValueError, match="give --base-url"):
        _run("--state-dir", str(tmp_path), "--backend", "openai")
    write_state(tmp_path, {"router_address": "127.0.0.1:6001"})
    with pytest.raises(ValueError, match="serves no HTTP API; give --base-url"):
        _run("--state-dir", str(tmp_path), "--backend", "openai")
