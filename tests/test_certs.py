"""The cluster CA and its leaf certificates work for mutually authenticated gRPC on loopback:
a CA-verified client with a cluster certificate gets through, a client without one, a client
trusting another CA and a plaintext client do not."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from serving.certs import create_ca, issue


@pytest.fixture(scope="module")
def mtls_server():
    ca = create_ca("test")
    leaf = issue(ca, "worker", ["127.0.0.1", "localhost"])
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    creds = grpc.ssl_server_credentials([(leaf.key_pem, leaf.cert_pem)], root_certificates=ca.cert_pem,
                                        require_client_auth=True)
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    yield ca, port
    server.stop(0)


def _check(channel: grpc.Channel) -> None:
    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)


def test_leaf_certificate_fields():
    ca = create_ca("c1")
    leaf = x509.load_pem_x509_certificate(issue(ca, "w", ["10.0.0.7", "node-a"]).cert_pem)
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]
    assert san.get_values_for_type(x509.DNSName) == ["node-a"]
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    with pytest.raises(ValueError, match="at least one host"):
        issue(ca, "w", [])


def test_mutual_tls(mtls_server):
    ca, port = mtls_server
    client = issue(ca, "router", ["127.0.0.1"])
    good = grpc.ssl_channel_credentials(ca.cert_pem, client.key_pem, client.cert_pem)
    _check(grpc.secure_channel(f"127.0.0.1:{port}", good))
    no_cert = grpc.ssl_channel_credentials(ca.cert_pem)
    other = create_ca("other")
    stranger = issue(other, "x", ["127.0.0.1"])
    wrong_ca = grpc.ssl_channel_credentials(other.cert_pem, stranger.key_pem, stranger.cert_pem)
    for bad in (grpc.secure_channel(f"127.0.0.1:{port}", no_cert),
                grpc.secure_channel(f"127.0.0.1:{port}", wrong_ca),
                grpc.insecure_channel(f"127.0.0.1:{port}")):
        with pytest.raises(grpc.RpcError) as info:
            _check(bad)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
