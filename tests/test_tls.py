"""TLS: the public plane (the router's gRPC and HTTP ports with a given certificate, clients
verifying it with a CA), internal mutual TLS with the cluster CA (a KV port refuses a peer
without a cluster certificate before anything is written), the flags, and one token-exact
request through a cluster with both."""

from __future__ import annotations

import argparse
import json
import os
import ssl
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kv_helpers import sender_cache, start_receiver

from common.model_config import ConfigError
from deploy.spec import public_tls_from_args
from kvtransfer import GrpcKvSender, KvTransferError
from loadtest.backends import openai_client
from loadtest.cli import configs_from_args
from loadtest.driver import server_info
from pdcluster import cli
from pdcluster.client import PdclusterClient
from pdcluster.v1 import router_pb2, router_pb2_grpc
from router.http import HttpServer
from router.openai.app import FrontDoorState, build_app
from serving.certs import create_ca, issue
from serving.registry import WorkerRegistry
from serving.rpc import add_health, set_serving
from serving.security import Plane, SecurityConfig, bind, internal_channel, make_server

from cluster_utils import assert_greedy_matches, assert_no_leak, hf_greedy, router_client, running_cluster

CA = create_ca("test-public")
LEAF = issue(CA, "router", ["127.0.0.1"])
PUBLIC = SecurityConfig(tls_cert=LEAF.cert_pem, tls_key=LEAF.key_pem)
CLUSTER_CA = create_ca("test-cluster")
INTERNAL = SecurityConfig(cluster_secret="s3cret", internal_ca_cert=CLUSTER_CA.cert_pem,
                          internal_ca_key=CLUSTER_CA.key_pem)


def test_config_pairs_hidden_pems_and_workers_without_the_public_certificate():
    both = SecurityConfig(tls_cert=LEAF.cert_pem.decode(), tls_key=LEAF.key_pem, internal_ca_cert=CLUSTER_CA.cert_pem,
                          internal_ca_key=CLUSTER_CA.key_pem)
    assert both.tls_cert == LEAF.cert_pem.decode() and both.public_tls and both.internal_tls
    assert b"PRIVATE" not in repr(both).encode() and "BEGIN" not in repr(both)
    workers = both.for_workers()
    assert not workers.public_tls and workers.internal_tls
    with pytest.raises(ValueError, match="certificate and its key"):
        SecurityConfig(tls_cert=LEAF.cert_pem)
    with pytest.raises(ValueError, match="cluster CA"):
        SecurityConfig(internal_ca_cert=CLUSTER_CA.cert_pem)
    assert INTERNAL.internal_identity("127.0.0.1") is INTERNAL.internal_identity("127.0.0.1")  # issued once
    with pytest.raises(ValueError, match="internal TLS is off"):
        SecurityConfig().internal_identity("127.0.0.1")


def test_tls_flags(tmp_path):
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_bytes(LEAF.cert_pem)
    key.write_bytes(LEAF.key_pem)
    assert public_tls_from_args(argparse.Namespace(tls_cert=None, tls_key=None)) == (b"", b"")
    assert public_tls_from_args(argparse.Namespace(tls_cert=cert, tls_key=key)) == (LEAF.cert_pem, LEAF.key_pem)
    with pytest.raises(ConfigError, match="go together"):
        public_tls_from_args(argparse.Namespace(tls_cert=cert, tls_key=None))
    with pytest.raises(ConfigError, match="--tls-key"):
        public_tls_from_args(argparse.Namespace(tls_cert=cert, tls_key=tmp_path / "missing.pem"))


# ---- the public plane ------------------------------------------------------------------------


class _Router(router_pb2_grpc.RouterServicer):
    def GetModelInfo(self, request, context):
        return router_pb2.ModelInfo(model_name="fake", max_model_len=64)

    def Generate(self, request, context):
        yield router_pb2.GenerateResponse(request_id="r", token_ids=[1], text="ok", finish_reason=2)


@pytest.fixture()
def tls_router():
    server = make_server(PUBLIC, Plane.PUBLIC, max_workers=4)
    router_pb2_grpc.add_RouterServicer_to_server(_Router(), server)
    set_serving(add_health(server), ["pdcluster.v1.Router"])
    address = f"127.0.0.1:{bind(server, '127.0.0.1', 0, PUBLIC, Plane.PUBLIC)}"
    server.start()
    yield address
    server.stop(None)


def test_public_grpc_needs_a_client_that_trusts_the_ca(tls_router, tmp_path):
    with PdclusterClient(tls_router, timeout_s=5) as plaintext:
        with pytest.raises(grpc.RpcError) as refused:
            plaintext.model_info()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    with PdclusterClient(tls_router, timeout_s=5, tls_ca=create_ca("other").cert_pem) as untrusting:
        with pytest.raises(grpc.RpcError) as refused:
            untrusting.model_info()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(CA.cert_pem)
    for tls_ca in (str(ca_file), CA.cert_pem, CA.cert_pem.decode()):
        with PdclusterClient(tls_router, timeout_s=5, tls_ca=tls_ca) as client:
            client.wait_ready(5)
            assert client.model_info().model_name == "fake"


def test_cli_generate_and_loadtest_take_the_ca(tls_router, tmp_path, capsys):
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(CA.cert_pem)
    assert cli.main(["generate", "--address", tls_router, "hi"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err
    assert cli.main(["generate", "--address", tls_router, "--tls-ca", str(ca_file), "hi"]) == 0
    assert capsys.readouterr().out.strip() == "ok"
    args = cli.build_parser().parse_args(["loadtest", "--address", tls_router, "--workload", "synthetic",
                                          "--tls-ca", str(ca_file)])
    _, run, _ = configs_from_args(args)
    assert run.tls_ca == str(ca_file)
    assert server_info(run).model_name == "fake"


def test_public_https_with_the_ca_and_no_pem_left_on_disk(monkeypatch, tmp_path):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)
    state = FrontDoorState(core=None, model_name="m", tokenizer=None, health=lambda: (True, ""), targets=lambda: [],
                           metrics_registry=None, accepts_api_key=PUBLIC.accepts_api_key, created=1, max_model_len=64)
    server = HttpServer(build_app(state), "127.0.0.1", 0, tls=(LEAF.cert_pem, LEAF.key_pem))
    written = list(tmp_path.iterdir())
    assert len(written) == 2 and all(os.stat(p).st_mode & 0o777 == 0o600 for p in written)
    port = server.start()
    try:
        assert list(tmp_path.iterdir()) == []  # removed once uvicorn listens
        context = ssl.create_default_context(cadata=CA.cert_pem.decode())
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/health", timeout=10, context=context) as r:
            assert r.status == 200
        ca_file = tmp_path / "ca.pem"
        ca_file.write_bytes(CA.cert_pem)
        with openai_client(f"https://127.0.0.1:{port}", None, 10, 0, tls_ca=str(ca_file)) as client:
            assert client.models.list().data[0].id == "m"  # the loadtest's openai backend
        assert cli.main(["top", "--address", f"127.0.0.1:{port}", "--tls-ca", str(ca_file), "--iterations", "1"]) == 0
        with pytest.raises(OSError):  # plain HTTP on a TLS port
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10).read()
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):  # not trusting the CA
            urllib.request.urlopen(f"https://127.0.0.1:{port}/health", timeout=10,
                                   context=ssl.create_default_context(cadata=create_ca("x").cert_pem.decode()))
    finally:
        server.stop()


# ---- the internal plane ----------------------------------------------------------------------


def test_kv_port_with_internal_tls_refuses_peers_without_a_cluster_certificate():
    """A decode worker's KV server with internal TLS: a plaintext sender and one with a certificate
    of another CA (even with the right cluster secret) fail the handshake (UNAVAILABLE); nothing is
    written and the reservation stays open; a sender with a cluster certificate gets through."""
    layers, blocks, bs = 2, 6, 4
    recv = start_receiver(layers, blocks, bs, security=INTERNAL)
    sink = recv.sink
    try:
        dest = recv.reserve("t1", [1, 2])
        gen = dest.generation
        src = sender_cache(layers, blocks, bs)
        other = create_ca("intruder")
        intruder = SecurityConfig(cluster_secret="s3cret", internal_ca_cert=CLUSTER_CA.cert_pem,
                                  internal_ca_key=other.key_pem)  # trusts the cluster, signs with its own key
        strangers = (partial(internal_channel, SecurityConfig(cluster_secret="s3cret")),
                     partial(internal_channel, SecurityConfig(cluster_secret="s3cret", internal_ca_cert=other.cert_pem,
                                                              internal_ca_key=other.key_pem)),
                     partial(internal_channel, intruder))
        for connect in strangers:
            sender = GrpcKvSender(timeout_s=5, connect=connect)
            with pytest.raises(KvTransferError, match="UNAVAILABLE"):
                sender.send("r1", "t1", dest, src, [0, 1], 7)
            sender.close()
        assert sink.writes == 0 and not sink.failed and not sink.completed
        assert sink.table.is_open("t1", gen) and bool((sink.table.kv_cache == -1.0).all())
        sender = GrpcKvSender(timeout_s=5, connect=partial(internal_channel, INTERNAL))
        sender.send("r1", "t1", dest, src, [0, 1], 7)
        sender.close()
        assert sink.completed == {"t1": 7} and sink.writes > 0
    finally:
        recv.server.stop(None)


# ---- a cluster with both ---------------------------------------------------------------------


def test_token_exact_through_a_fully_tls_cluster(tmp_path, hf_model, tokenizer):
    cert, key = tmp_path / "router.pem", tmp_path / "router.key"
    cert.write_bytes(LEAF.cert_pem)
    key.write_bytes(LEAF.key_pem)
    state_dir = tmp_path / "state"
    with running_cluster(state_dir, "--internal-tls", "--tls-cert", str(cert), "--tls-key", str(key),
                         "--max-model-len", "512", "--num-kv-blocks", "300", "--heartbeat-s", "0.5") as state:
        saved = json.loads((state_dir / "cluster.json").read_text())
        assert "BEGIN" in saved["internal_ca_key"] and (state_dir / "cluster.json").stat().st_mode & 0o777 == 0o600
        with PdclusterClient(state["router_address"], timeout_s=5) as plaintext:
            with pytest.raises(grpc.RpcError):
                plaintext.model_info()
        prompt = tokenizer.encode("The capital of France is")
        ref, gaps = hf_greedy(hf_model, prompt, 12)
        with router_client(state, tls_ca=CA.cert_pem) as client:
            out = client.generate(prompt, max_tokens=12, temperature=0)
        assert_greedy_matches(list(out.token_ids), ref, gaps, "fully TLS cluster")
        ca_file = tmp_path / "ca.pem"
        ca_file.write_bytes(CA.cert_pem)
        with openai_client(f"https://{state['router_http_address']}", None, 300, 0, tls_ca=str(ca_file)) as oai:
            model = oai.models.list().data[0].id  # HTTPS through the port's TLS gate (router.tls_gate)
            chunks = oai.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True)
            assert "".join(c.choices[0].text for c in chunks if c.choices) == out.text
            stream = oai.completions.create(model=model, prompt=prompt, max_tokens=400, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
            next(iter(stream))
            stream.close()  # a client that leaves mid-stream: the request ends, its blocks go back
        assert_no_leak(state, timeout_s=3.0)  # GetLoad of every worker over the cluster's mutual TLS
        plaintext = SecurityConfig(cluster_secret=state["cluster_secret"])  # the secret, but no certificate
        for info, _ in WorkerRegistry(state["redis_url"], state["cluster"]).live_workers():
            for address in filter(None, (info.address, info.kv_endpoint)):
                with internal_channel(plaintext, address) as channel, pytest.raises(grpc.RpcError) as refused:
                    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, address
    assert not Path(state_dir / "cluster.json").exists()
