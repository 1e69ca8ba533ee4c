"""Authentication without a cluster: the credentials' config, the gRPC interceptor on both planes
(a refused call never reaches its handler; health answers without credentials), the client and
the CLI sending an API key, the HTTP middleware, API-key loading from flags / file / environment,
the ``up`` warning, the state file's mode, and the Prometheus config with a key."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import urllib.error
import urllib.request
from functools import partial

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kv_helpers import sender_cache, start_receiver

from common.grpc_metadata import bearer, bearer_token
from common.model_config import ConfigError
from deploy.prometheus_server import PrometheusServer
from deploy.spec import api_keys_from_args, exposure_warning
from deploy.state import read_state, state_path, write_state
from kvtransfer import GrpcKvSender, KvTransferError
from loadtest.cli import configs_from_args
from pdcluster import cli
from pdcluster.client import API_KEY_ENV, PdclusterClient
from pdcluster.v1 import router_pb2, router_pb2_grpc
from router.http import HttpServer
from router.openai.app import FrontDoorState, build_app
from router.server import RouterConfig
from serving.rpc import add_health, set_serving
from serving.security import Plane, SecurityConfig, bind, internal_channel, make_server

KEYS = SecurityConfig(api_keys=("k1", "k2"), cluster_secret="s3cret")


# ---- the config ------------------------------------------------------------------------------


def test_config_validates_normalizes_and_hides_credentials():
    cfg = SecurityConfig(api_keys=["k1", "k2", "k1"], cluster_secret="s")
    assert cfg.api_keys == ("k1", "k2") and "k1" not in repr(cfg) and "'s'" not in repr(cfg)
    assert cfg.for_workers() == SecurityConfig(cluster_secret="s")
    for bad in ("", "two words", "caf\u00e9", "tab\tkey"):
        with pytest.raises(ValueError, match="printable ASCII"):
            SecurityConfig(api_keys=(bad,))
    with pytest.raises(ValueError, match="cluster secret"):
        SecurityConfig(cluster_secret="new\nline")


def test_accepts_compares_every_key_and_open_means_open():
    assert KEYS.accepts_api_key("k1") and KEYS.accepts_api_key("k2")
    assert not any(KEYS.accepts_api_key(k) for k in (None, "", "k", "k1 ", "k12", "s3cret", "caf\u00e9"))
    assert KEYS.accepts_cluster_secret("s3cret") and not KEYS.accepts_cluster_secret("k1")
    assert not KEYS.accepts_cluster_secret(None)
    assert SecurityConfig().accepts_api_key(None) and SecurityConfig().accepts_cluster_secret(None)


def test_bearer_token_parsing():
    assert bearer("k1") == ("authorization", "Bearer k1")
    assert bearer_token("Bearer k1") == "k1" and bearer_token("bearer  k1 ") == "k1"
    assert [bearer_token(v) for v in (None, "", "k1", "Basic k1", "Bearer", "Bearer ")] == [None] * 6


# ---- gRPC: both planes -----------------------------------------------------------------------


class _Router(router_pb2_grpc.RouterServicer):
    def __init__(self) -> None:
        self.calls = 0

    def GetModelInfo(self, request, context):
        self.calls += 1
        return router_pb2.ModelInfo(model_name="fake", max_model_len=64)

    def Generate(self, request, context):
        self.calls += 1
        yield router_pb2.GenerateResponse(request_id="r", token_ids=[1], finish_reason=2)


@pytest.fixture()
def router():
    """A fake Router on a public-plane server with API keys k1, k2."""
    server = make_server(KEYS, Plane.PUBLIC, max_workers=4)
    servicer = _Router()
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    set_serving(add_health(server), ["pdcluster.v1.Router"])
    address = f"127.0.0.1:{bind(server, '127.0.0.1', 0, KEYS, Plane.PUBLIC)}"
    server.start()
    yield address, servicer
    server.stop(None)


def test_public_plane_refuses_before_the_handler_and_health_is_exempt(router):
    address, servicer = router
    for key in (None, "wrong", "s3cret"):
        with PdclusterClient(address, timeout_s=5, api_key=key) as client:
            client.wait_ready(5)  # health needs no key
            for call in (client.model_info, lambda: client.generate("hi")):
                with pytest.raises(grpc.RpcError) as refused:
                    call()
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "authorization: Bearer KEY" in refused.value.details()
    assert servicer.calls == 0
    for key in ("k1", "k2"):
        with PdclusterClient(address, timeout_s=5, api_key=key) as client:
            assert client.model_info().model_name == "fake" and client.generate("hi").token_ids == [1]
    assert servicer.calls == 4


def test_cli_commands_send_the_key_from_the_flag_or_the_environment(router, monkeypatch, capsys):
    address, _ = router
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert cli.main(["generate", "--address", address, "hi"]) == 1
    err = capsys.readouterr().err  # names where the key goes (helper finding: it spoke of gRPC metadata alone)
    assert "UNAUTHENTICATED" in err and f"--api-key or ${API_KEY_ENV}" in err, err
    assert cli.main(["generate", "--address", address, "--api-key", "k2", "hi"]) == 0
    monkeypatch.setenv(API_KEY_ENV, "k1")
    assert cli.main(["generate", "--address", address, "hi"]) == 0
    assert cli.main(["generate", "--address", address, "--api-key", "wrong", "hi"]) == 1  # the flag wins
    args = cli.build_parser().parse_args(["loadtest", "--address", address, "--workload", "synthetic"])
    _, run, _ = configs_from_args(args)
    assert run.api_key == "k1" and "k1" not in repr(run)


def test_internal_plane_refuses_kv_pushes_without_the_secret_and_nothing_is_written():
    """A decode worker's KV server: a push without the cluster secret (or with an API key) is refused
    UNAUTHENTICATED before the receiver runs; the reservation stays open and the cache untouched;
    a sender whose channels come from ``internal_channel`` gets through."""
    layers, blocks, bs = 2, 6, 4
    recv = start_receiver(layers, blocks, bs, security=KEYS.for_workers())
    sink, endpoint = recv.sink, recv.endpoint
    try:
        dest = recv.reserve("t1", [1, 2])
        gen = dest.generation
        src = sender_cache(layers, blocks, bs)
        wrong_key = partial(internal_channel, SecurityConfig(cluster_secret="k1"))
        for sender in (GrpcKvSender(timeout_s=5), GrpcKvSender(timeout_s=5, connect=wrong_key)):
            with pytest.raises(KvTransferError, match="UNAUTHENTICATED.*cluster secret"):
                sender.send("r1", "t1", dest, src, [0, 1], 7)
            sender.close()
        assert sink.writes == 0 and not sink.failed and not sink.completed
        assert sink.table.is_open("t1", gen) and bool((sink.table.kv_cache == -1.0).all())
        with grpc.insecure_channel(endpoint) as channel:  # health without credentials
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        sender = GrpcKvSender(timeout_s=5, connect=partial(internal_channel, KEYS))
        sender.send("r1", "t1", dest, src, [0, 1], 7)
        sender.close()
        assert sink.completed == {"t1": 7} and sink.writes > 0
    finally:
        recv.server.stop(None)


# ---- HTTP ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def http():
    """The router's real FastAPI app (no request path behind it) with API keys k1, k2."""
    state = FrontDoorState(core=None, model_name="m", tokenizer=None, health=lambda: (True, ""),
                           targets=lambda: [{"targets": ["127.0.0.1:1"], "labels": {}}], metrics_registry=None,
                           accepts_api_key=KEYS.accepts_api_key, created=1, max_model_len=64)
    server = HttpServer(build_app(state), "127.0.0.1", 0)
    port = server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def _get(url: str, key: str | None = None, method: str = "GET", body: bytes | None = None,
         scheme: str = "Bearer") -> tuple[int, dict, dict]:
    headers = {"Authorization": f"{scheme} {key}"} if key is not None else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers, method=method),
                                    timeout=10) as r:
            return r.status, dict(r.headers), json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read() or b"null")


@pytest.mark.parametrize("method, path, body", [
    ("GET", "/v1/models", None), ("POST", "/v1/completions", b"{not json"),
    ("POST", "/v1/chat/completions", b'{"model": "m", "messages": []}'), ("GET", "/v1/prometheus/targets", None),
    ("GET", "/metrics", None), ("GET", "/no/such/route", None)])
def test_http_refuses_every_route_but_health_without_a_valid_key(http, method, path, body):
    for key, scheme in ((None, "Bearer"), ("wrong", "Bearer"), ("k1", "Basic"), ("s3cret", "Bearer")):
        status, headers, doc = _get(http + path, key, method, body, scheme)
        assert status == 401 and headers.get("www-authenticate") == "Bearer", (key, scheme, status, doc)
        assert doc["error"]["type"] == "authentication_error" and doc["error"]["code"] == "invalid_api_key"


def test_http_passes_a_valid_key_and_health_needs_none(http):
    assert _get(http + "/health")[0] == 200
    status, _, doc = _get(http + "/v1/models", "k2")
    assert status == 200 and doc["data"][0]["id"] == "m"
    assert _get(http + "/v1/prometheus/targets", "k1", scheme="bearer")[0] == 200
    with openai.OpenAI(base_url=http + "/v1", api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    with openai.OpenAI(base_url=http + "/v1", api_key="k1", max_retries=0) as client:
        assert client.models.list().data[0].id == "m"


# ---- deploy: keys from flags, the warning, the state file, Prometheus -------------------------


def _up(monkeypatch, *flags: str, env: str | None = None):
    if env is None:
        monkeypatch.delenv(API_KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(API_KEY_ENV, env)
    return cli.build_parser().parse_args(["up", "--local", *flags])


def test_api_keys_from_flags_file_and_environment(monkeypatch, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# ops team\nk3\n\n  k4  \n")
    assert api_keys_from_args(_up(monkeypatch)) == ()
    assert api_keys_from_args(_up(monkeypatch, env="k0")) == ("k0",)
    assert api_keys_from_args(_up(monkeypatch, "--api-key", "k1", "--api-key", "k2", env="k0")) == ("k1", "k2")
    assert api_keys_from_args(_up(monkeypatch, "--api-key-file", str(keys), env="k0")) == ("k3", "k4")
    assert api_keys_from_args(_up(monkeypatch, "--api-key", "k1", "--api-key-file", str(keys))) == ("k1", "k3", "k4")
    (tmp_path / "empty").write_text("# none\n\n")
    with pytest.raises(ConfigError, match="holds no key"):
        api_keys_from_args(_up(monkeypatch, "--api-key-file", str(tmp_path / "empty")))
    with pytest.raises(ConfigError, match="--api-key-file"):
        api_keys_from_args(_up(monkeypatch, "--api-key-file", str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="printable ASCII"):
        api_keys_from_args(_up(monkeypatch, "--api-key", "two words"))


@pytest.mark.parametrize("host, keys, warns", [
    ("127.0.0.1", (), False), ("::1", (), False), ("localhost", (), False), ("0.0.0.0", (), True),
    ("10.0.0.5", (), True), ("node-a", (), True), ("0.0.0.0", ("k1",), False)])
def test_up_warns_when_the_router_listens_beyond_loopback_without_keys(host, keys, warns):
    router = RouterConfig(model="m", model_path="/m", redis_url="redis://x", host=host,
                          security=SecurityConfig(api_keys=keys))
    warning = exposure_warning(router)
    assert (warning is not None) == warns
    assert warning is None or (host in warning and API_KEY_ENV in warning)


def test_state_file_is_written_owner_only(tmp_path):
    path = state_path(tmp_path)
    path.write_text("{}")
    os.chmod(path, 0o644)
    write_state(tmp_path, {"cluster_secret": "s"})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and read_state(tmp_path) == {"cluster_secret": "s"}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="Debian's prometheus package is not installed")
def test_prometheus_config_with_a_key(tmp_path):
    PrometheusServer("127.0.0.1:8000", tmp_path, api_key="k1")
    config = (tmp_path / "prometheus.yml").read_text()
    assert config.count("\n    authorization:\n      type: Bearer\n      credentials_file: api_key\n") == 1
    assert config.count("\n        authorization:\n          type: Bearer\n          credentials_file: api_key\n") == 1
    key_file = tmp_path / "api_key"
    assert key_file.read_text() == "k1" and stat.S_IMODE(key_file.stat().st_mode) == 0o600
    check = subprocess.run(["promtool", "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    PrometheusServer("127.0.0.1:8000", tmp_path / "open")
    assert "\n    authorization:" not in (tmp_path / "open" / "prometheus.yml").read_text()


def test_internal_channel_sends_the_secret_only_when_there_is_one():
    seen: list = []

    class _Probe(grpc.ServerInterceptor):
        def intercept_service(self, continuation, details):
            seen.append(dict(details.invocation_metadata))
            return continuation(details)

    server = make_server(SecurityConfig(), Plane.INTERNAL, max_workers=2, interceptors=[_Probe()])
    add_health(server)
    address = f"127.0.0.1:{bind(server, '127.0.0.1', 0, SecurityConfig(), Plane.INTERNAL)}"
    server.start()
    try:
        for security in (KEYS, SecurityConfig()):
            with internal_channel(security, address) as channel:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        server.stop(None)
    assert seen[0].get("x-pdcluster-cluster-secret") == "s3cret" and "authorization" not in seen[0]
    assert "x-pdcluster-cluster-secret" not in seen[1]
