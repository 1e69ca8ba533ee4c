"""Every ``pdcluster`` command that talks to a cluster prints one clear line (no traceback)
on stderr and exits non-zero when what it talks to is unreachable: ``status`` (Redis),
``scale`` (Ray), ``generate`` (the router's gRPC port), ``top`` (its HTTP port),
``loadtest --backend openai`` (an OpenAI-compatible server), ``up --ray-address`` (Ray).

So does an operator's mistake, found before anything starts: a flag out of range (exit
status 2, naming the flag and its limit, not the config field behind it), ``up`` from a
state directory a cluster is already up from (saying how to stop that one), a router port
something already listens on, a ``--tls-ca`` that cannot be read. (And ``--version``.)"""

from __future__ import annotations

import json
import pickle
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


def test_status_without_redis(dead_state, capsys, dead_address):
    """Ray's head answers (a listening socket stands for it): Redis is restarting, try again; Ray gone
    too: the cluster died, and the line says how to clear what is left (it never comes back alone)."""
    state = json.loads((dead_state / "cluster.json").read_text())
    with socket.socket() as head:
        head.bind(("127.0.0.1", 0))
        head.listen()
        state["ray_address"] = "127.0.0.1:%d" % head.getsockname()[1]
        (dead_state / "cluster.json").write_text(json.dumps(state))
        _one_error_line(capsys, cli.main(["status", "--state-dir", str(dead_state)]),
                        "it is the one given to `up --redis-url`")  # nobody restarts that one
        (dead_state / "cluster.json").write_text(json.dumps({**state, "started_redis": True}))
        _one_error_line(capsys, cli.main(["status", "--state-dir", str(dead_state)]),
                        "cannot reach the cluster's Redis")
        rc = cli.main(["status", "--json", "--state-dir", str(dead_state)])
        out, _ = capsys.readouterr()  # with --json, a document on stdout too (helper finding: stdout was empty)
        doc = json.loads(out)
        assert rc == 1 and doc["up"] is True and doc["redis_ok"] is False and "try again" in doc["error"]
    _one_error_line(capsys, cli.main(["status", "--state-dir", str(dead_state)]),
                    f"neither the cluster's Redis nor its Ray head at {state['ray_address']} answers: the cluster is "
                    f"down (its processes died?); clear what is left of it with `pdcluster down --state-dir "
                    f"{dead_state}`")


def test_scale_without_ray(dead_state, capsys, dead_address):
    rc = cli.main(["scale", "--prefill", "2", "--decode", "1", "--state-dir", str(dead_state)])
    _one_error_line(capsys, rc, f"cannot reach the cluster's Ray at {dead_address}")


@pytest.mark.parametrize(("flags", "needle"), [
    (["--decode", "0"], "need at least one prefill and one decode worker"),
    (["--workers", "2"], "this cluster is disaggregated: scale it with --prefill and --decode"),
])
def test_scale_to_an_impossible_mix_is_refused_before_ray(dead_state, capsys, flags, needle):
    state = json.loads((dead_state / "cluster.json").read_text())
    state["workers"] = [{"worker_id": "prefill-0", "role": "prefill"}, {"worker_id": "decode-0", "role": "decode"}]
    (dead_state / "cluster.json").write_text(json.dumps(state))
    _one_error_line(capsys, cli.main(["scale", *flags, "--state-dir", str(dead_state)]), needle)


def test_generate_without_router(capsys, dead_address):
    _one_error_line(capsys, cli.main(["generate", "--address", dead_address, "hi"]), "UNAVAILABLE")


def test_generate_with_a_value_the_client_refuses(capsys, dead_address):
    # refused before any call: one line naming the parameter, exit status 2 (no traceback)
    rc = cli.main(["generate", "--address", dead_address, "--max-tokens", "-1", "hi"])
    _one_error_line(capsys, rc, "max_tokens must be >= 1, got -1")
    assert rc == 2


def test_top_on_the_grpc_port_says_so(capsys):
    """Something that answers, not in HTTP (the router's gRPC port, say): one line, no traceback."""
    import threading

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        threading.Thread(target=lambda: server.accept()[0].sendall(b"\x00\x00\x12\x04garbage\r\n\r\n"),
                         daemon=True).start()
        rc = cli.main(["top", "--address", f"127.0.0.1:{server.getsockname()[1]}", "--iterations", "1"])
    _one_error_line(capsys, rc, "does not answer HTTP (BadStatusLine); is it the router's gRPC port?")


def test_top_without_router(capsys, dead_address):
    rc = cli.main(["top", "--address", dead_address, "--iterations", "1"])
    _one_error_line(capsys, rc, f"cannot reach the router's HTTP server at http://{dead_address}")


def test_top_finds_the_router_in_state_dir(dead_state, capsys, dead_address):
    rc = cli.main(["top", "--state-dir", str(dead_state), "--iterations", "1"])
    _one_error_line(capsys, rc, f"cannot reach the router's HTTP server at http://{dead_address}")


def test_loadtest_without_server(capsys, dead_address):
    rc = cli.main(["loadtest", "--backend", "openai", "--base-url", f"http://{dead_address}", "--workload",
                   "synthetic", "--num-requests", "2", "--no-progress", "--tokenizer", "smollm2-135m-instruct"])
    _one_error_line(capsys, rc, f"no model listed at http://{dead_address}/v1/models")


def _one_usage_line(capsys, rc: int, line: str) -> None:
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    assert err.strip() == line and "Traceback" not in out + err, err


@pytest.mark.parametrize(("flags", "line"), [
    (["--decode", "-1"], "--decode must be >= 0, got -1"),
    (["--workers", "-2"], "--workers must be >= 0, got -2"),
    (["--timeout-s", "-5"], "--timeout-s must be > 0, got -5"),
    (["--drain-timeout-s", "-1"], "--drain-timeout-s must be > 0, got -1"),
    (["--placement-timeout-s", "0"], "--placement-timeout-s must be > 0, got 0"),
])
def test_scale_flag_out_of_range(dead_state, capsys, flags, line):
    # refused before the state file is read or Ray is reached
    rc = cli.main(["scale", "--state-dir", str(dead_state), *flags])
    _one_usage_line(capsys, rc, f"pdcluster scale: error: {line}")


def test_scale_target_names_its_field():
    from common.model_config import FieldError
    from deploy.scale import ScaleTarget

    with pytest.raises(FieldError, match=r"^start_timeout_s must be > 0, got -5$") as err:
        ScaleTarget(start_timeout_s=-5.0)
    assert (err.value.field, err.value.value) == ("start_timeout_s", -5.0)
    back = pickle.loads(pickle.dumps(err.value))  # as a Ray actor raises it
    assert (str(back), back.field) == (str(err.value), "start_timeout_s")


@pytest.mark.parametrize(("flags", "line"), [
    (["--decode", "-1"], "--decode must be >= 0, got -1"),
    (["--colocated", "--workers", "-1"], "--workers must be >= 0, got -1"),
    (["--timeout-s", "0"], "--timeout-s must be > 0, got 0"),
    (["--placement-timeout-s", "0"], "--placement-timeout-s must be > 0, got 0"),
    (["--worker-cpus", "0"], "--worker-cpus must be > 0, got 0"),
])
def test_up_flag_out_of_range(tmp_path, capsys, flags, line):
    rc = cli.main(["up", "--local", "--state-dir", str(tmp_path / "state"), *flags])
    _one_usage_line(capsys, rc, f"pdcluster up: error: {line}")
    assert not (tmp_path / "state").exists()  # refused before anything started


@pytest.mark.parametrize(("flags", "needle"), [
    (["--dtype", "foo"], "argument --dtype: invalid choice: 'foo'"),
    (["--kv-cache-gb", "0"], "argument --kv-cache-gb: must be > 0, got 0"),
    (["--redis-port", "70000"], "argument --redis-port: port must be in [0, 65535], got 70000"),
    (["--kv-layers-per-chunk", "0"], "argument --kv-layers-per-chunk: must be >= 1, got 0"),
    (["--kv-timeout-s", "0"], "argument --kv-timeout-s: must be > 0, got 0"),
    (["--kv-lease-s", "-1"], "argument --kv-lease-s: must be > 0, got -1"),
    (["--heartbeat-s", "0"], "argument --heartbeat-s: must be > 0, got 0"),
    (["--heartbeat-s", "nan"], "argument --heartbeat-s: must be > 0, got nan"),
    (["--num-kv-blocks", "1"], "argument --num-kv-blocks: must be 0 (derive from --kv-cache-gb) or >= 2, got 1"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--max-migrations", "-1"], "argument --max-migrations: must be an integer in [0, 100], got -1"),
    (["--max-migrations", "x"], "argument --max-migrations: must be an integer, got 'x'"),
    (["--breaker-failures", "1.5"], "argument --breaker-failures: must be an integer, got '1.5'"),
    (["--kv-timeout-s", "soon"], "argument --kv-timeout-s: must be a number, got 'soon'"),
])
def test_up_flag_refused_by_the_parser(capsys, flags, needle):
    with pytest.raises(SystemExit) as info:
        cli.main(["up", "--local", *flags])
    assert info.value.code == 2 and needle in capsys.readouterr().err


def test_up_needs_local_or_ray_address(tmp_path, capsys):
    rc = cli.main(["up", "--state-dir", str(tmp_path)])
    _one_usage_line(capsys, rc, "pdcluster up: error: give --local (start Ray here) or --ray-address ADDR")


def test_up_from_a_state_dir_already_in_use(dead_state, capsys):
    before = (dead_state / "cluster.json").read_text()
    rc = cli.main(["up", "--local", "--state-dir", str(dead_state)])
    _one_error_line(capsys, rc, f"pdcluster down --state-dir {dead_state}")
    assert rc == 1 and (dead_state / "cluster.json").read_text() == before  # that cluster's state untouched


@pytest.mark.parametrize("flag", ["--port", "--http-port"])
def test_up_on_a_port_in_use(tmp_path, capsys, flag):
    """Another cluster's router (gRPC listens with SO_REUSEPORT) on the port: refused before Ray starts."""
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        other = "--http-port" if flag == "--port" else "--port"
        rc = cli.main(["up", "--local", flag, str(port), other, "0", "--state-dir", str(tmp_path)])
    _one_usage_line(capsys, rc, f"pdcluster up: error: {flag} {port}: 127.0.0.1:{port} is in use (Address already "
                                f"in use; another pdcluster started without its own {flag}?); stop what listens "
                                f"there or choose another port ({flag} 0: any free port)")
    assert not (tmp_path / "cluster.json").exists()


def test_up_with_local_and_ray_address(tmp_path, capsys, dead_address):
    rc = cli.main(["up", "--local", "--ray-address", dead_address, "--state-dir", str(tmp_path)])
    _one_usage_line(capsys, rc, "pdcluster up: error: give --local (start Ray here) or --ray-address ADDR, not both")


def test_up_with_one_port_for_grpc_and_http(tmp_path, capsys):
    rc = cli.main(["up", "--local", "--port", "50999", "--http-port", "50999", "--state-dir", str(tmp_path)])
    _one_usage_line(capsys, rc, "pdcluster up: error: --http-port 50999 is also --port: the gRPC and HTTP ports "
                                "must differ (--http-port 0: any free port)")
    assert not (tmp_path / "cluster.json").exists()


def test_up_without_ray(tmp_path, capsys, dead_address):
    rc = cli.main(["up", "--ray-address", dead_address, "--state-dir", str(tmp_path)])
    _one_error_line(capsys, rc, f"cannot reach the cluster's Ray at {dead_address}")


def test_unreadable_tls_ca(capsys, dead_address, tmp_path):
    missing = tmp_path / "ca.pem"
    rc = cli.main(["generate", "--address", dead_address, "--tls-ca", str(missing), "hi"])
    _one_error_line(capsys, rc, f"--tls-ca {missing}: No such file or directory")
    assert rc == 2
    missing.write_text("not a certificate")
    rc = cli.main(["top", "--address", dead_address, "--tls-ca", str(missing), "--iterations", "1"])
    _one_error_line(capsys, rc, f"--tls-ca {missing}: ")


def test_top_interval_must_be_positive(capsys, dead_address):
    with pytest.raises(SystemExit) as info:
        cli.main(["top", "--address", dead_address, "--interval", "0"])
    assert info.value.code == 2 and "--interval must be > 0 (seconds), got 0" in capsys.readouterr().err


def test_status_of_no_cluster_and_a_file_as_state_dir(tmp_path, capsys):
    """``--json`` prints JSON on stdout even when no cluster is up (the reason on stderr); a file given as
    ``--state-dir`` is one usage line, not a traceback."""
    assert cli.main(["status", "--json", "--state-dir", str(tmp_path / "none")]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out) == {"up": False} and err.strip() == f"no pdcluster is up from state dir {tmp_path / 'none'}"
    state_file = tmp_path / "cluster.json"
    state_file.write_text("{}")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["status", "--state-dir", str(state_file)])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and f"{state_file} is a file, not a directory" in err and "Traceback" not in err



def test_loadtest_refused_by_the_router_prints_the_status(capsys):
    """A router that refuses the call (no API key given to a cluster that needs one) is one line
    with the status and its details, not the gRPC error object's repr (helper finding)."""
    import grpc
    from concurrent import futures

    class RefuseAll(grpc.GenericRpcHandler):
        def service(self, handler_call_details):
            def refuse(request, context):
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")
            return grpc.unary_unary_rpc_method_handler(refuse)

    server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[RefuseAll()])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        rc = cli.main(["loadtest", "--address", f"127.0.0.1:{port}", "--workload", "synthetic", "--num-requests", "2",
                       "--no-progress", "--tokenizer", "smollm2-135m-instruct"])
    finally:
        server.stop(None)
    _one_error_line(capsys, rc, "error: UNAUTHENTICATED: missing or invalid API key")


def test_version(capsys):
    """``pdcluster --version``, as vLLM's CLI has (helper finding: it was a usage error)."""
    from importlib.metadata import version
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"pdcluster {version('pdcluster')}"


def test_the_fallback_address_names_why_it_was_tried(tmp_path, monkeypatch):
    """No ``--address`` and no cluster up from ``~/.pdcluster``: an unreachable 127.0.0.1:50051 says that
    it was only the fallback; with a cluster up from there, or an address given, nothing is added."""
    import argparse

    from deploy import state

    monkeypatch.setattr(state, "DEFAULT_STATE_DIR", tmp_path)
    bare = argparse.Namespace(address=None, state_dir=None)
    assert "no pdcluster is up from ~/.pdcluster, so 127.0.0.1:50051 was tried" in cli._fallback_hint(
        bare, cli.FALLBACK_ADDRESS, cli.FALLBACK_ADDRESS)
    assert cli._fallback_hint(argparse.Namespace(address="h:1", state_dir=None), "h:1", cli.FALLBACK_ADDRESS) == ""
    (tmp_path / "cluster.json").write_text(json.dumps({"router_address": cli.FALLBACK_ADDRESS}))
    assert cli._fallback_hint(bare, cli.FALLBACK_ADDRESS, cli.FALLBACK_ADDRESS) == ""


def test_waiting_on_a_port_that_is_not_grpc_says_so():
    """An HTTP/1 port given as the router's gRPC address (the loadtest's ``--address``): the timeout
    says something listens there but speaks no gRPC, not that nothing answers."""
    from pdcluster.client import PdclusterClient

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with PdclusterClient(f"127.0.0.1:{server.getsockname()[1]}") as client:
            with pytest.raises(TimeoutError, match="something listens there but does not speak gRPC"):
                client.wait_ready(1.0)
