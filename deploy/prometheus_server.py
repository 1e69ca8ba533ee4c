"""A local Prometheus server (Debian's ``prometheus`` binary) scraping one pdcluster, and its HTTP API.

Used by the tests and the dashboard snapshot: it writes a config from
``deploy/prometheus/prometheus.yml`` (service discovery at the router's HTTP address; with an
API key, its ``authorization`` blocks enabled and the key in ``api_key`` beside it, mode 0600) with
the recording rules of ``deploy/prometheus/pdcluster.rules.yml``, starts Prometheus on a free
loopback port with its data in a given folder, and answers PromQL queries through
``/api/v1/query`` and ``/api/v1/query_range``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

from deploy.redis_server import free_port

PROMETHEUS_DIR = Path(__file__).resolve().parent / "prometheus"


def find_prometheus() -> str | None:
    """Path of the ``prometheus`` binary, or ``None`` (``apt-get install prometheus``)."""
    return shutil.which("prometheus")


class PrometheusServer:
    """Prometheus scraping the cluster whose router serves HTTP at ``router_http``.

    Args:
        router_http: ``host:port`` of the router's HTTP server (its ``/v1/prometheus/targets``).
        data_dir: folder for the config copy, the TSDB and the log.
        interval_s: scrape and rule-evaluation interval (seconds).
        api_key: one of the router's API keys (``None``: the router has none).
    """

    def __init__(self, router_http: str, data_dir: Path, interval_s: float = 1.0,
                 api_key: str | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        config = (PROMETHEUS_DIR / "prometheus.yml").read_text().replace("ROUTER_HTTP", router_http)
        interval = f"{int(interval_s * 1000)}ms"
        config = config.replace("scrape_interval: 5s", f"scrape_interval: {interval}").replace(
            "evaluation_interval: 5s", f"evaluation_interval: {interval}").replace(
            "refresh_interval: 5s", f"refresh_interval: {interval}")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if api_key is not None:
            key_file = self.data_dir / "api_key"
            key_file.touch(mode=0o600)
            key_file.write_text(api_key)
            config = re.sub(r"# (authorization:|  type: Bearer|  credentials_file: api_key)", r"\1", config)
        shutil.copy(PROMETHEUS_DIR / "pdcluster.rules.yml", self.data_dir / "pdcluster.rules.yml")
        (self.data_dir / "prometheus.yml").write_text(config)

    def start(self, timeout_s: float = 60.0) -> "PrometheusServer":
        """Start and wait until ``/-/ready``.

        Raises:
            FileNotFoundError: no ``prometheus`` binary on PATH.
            RuntimeError: it exited or was not ready within ``timeout_s`` (with its log).
        """
        binary = find_prometheus()
        if binary is None:
            raise FileNotFoundError("prometheus is not installed (Debian: apt-get install prometheus)")
        log = open(self.data_dir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={self.data_dir / 'prometheus.yml'}", f"--storage.tsdb.path={self.data_dir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"prometheus did not start: {(self.data_dir / 'prometheus.log').read_text()[-3000:]}")

    def api(self, path: str, **params) -> dict:
        """``GET /api/v1/{path}`` with ``params``; returns ``data``.

        Raises:
            RuntimeError: the API answered an error.
        """
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as r:
            doc = json.loads(r.read())
        if doc.get("status") != "success":
            raise RuntimeError(f"prometheus {path} {params}: {doc}")
        return doc["data"]

    def query(self, promql: str) -> list[dict]:
        """Instant query: the result vector (``[{"metric": {...}, "value": [t, "v"]}]``)."""
        return self.api("query", query=promql)["result"]

    def query_range(self, promql: str, start: float, end: float, step_s: float) -> list[dict]:
        """Range query: ``[{"metric": {...}, "values": [[t, "v"], ...]}]``."""
        return self.api("query_range", query=promql, start=start, end=end, step=step_s)["result"]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None
