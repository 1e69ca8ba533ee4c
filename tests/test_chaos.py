"""Chaos: a 2P+2D local cluster serves a 60-request mixed-length replay (Azure 2023
conversation lengths clipped to 128 prompt tokens, real prompt text) twice: fault-free,
then while a random worker is killed (``kill -9``) every ~6 s and Redis once. Every
request completes — the router migrates the ones whose worker died — with the greedy
output of the fault-free run (a divergence only at a near tie: top-2 logprobs of the
fault-free run within 1e-2, the suite's rule; the fault-free path itself is checked
against HF in ``tests/test_e2e.py``), migrations are counted, and no KV block is held
after the drain.

Sized for CI: the prompts' prefill is most of the run's compute on two cores (at 256 tokens
the test took ~4.5 minutes, now ~2.3). Kills come more often than the issue's ~10 s so that
even a fast machine's short faulty phase (~50 s here: 7 workers killed, ~20 requests
migrated) sees several. ``bench/soak.py`` runs the same for 30 minutes with longer prompts
and reports latencies with and without faults.
"""

from __future__ import annotations

import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from deploy.chaos import ChaosConfig, ChaosMonkey
from loadtest.prompts import PromptFactory
from loadtest.traces import default_traces_dir
from loadtest.workload import WorkloadConfig, build_plan
from serving.registry import WorkerRegistry

from cluster_utils import assert_greedy_matches, assert_no_leak, router_client, running_cluster

HEARTBEAT_S = 0.5
NUM_REQUESTS = 60
MAX_INPUT_TOKENS = 128


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("state"), "--prefill", "2", "--decode", "2",
                         "--max-model-len", "512", "--num-kv-blocks", "300",
                         "--heartbeat-s", str(HEARTBEAT_S)) as state:
        yield state


def _workload(tokenizer) -> list[tuple[list[int], int]]:
    plan, _ = build_plan(WorkloadConfig(source="azure-conv", num_requests=NUM_REQUESTS,
                                        max_input_tokens=MAX_INPUT_TOKENS, max_output_tokens=32, seed=3))
    factory = PromptFactory.from_tokenizer(tokenizer, default_traces_dir(), seed=3)
    return [(factory.prompt(r), max(4, r.output_tokens)) for r in plan]


def _migrations(cluster: dict) -> float:
    text = urllib.request.urlopen(f"http://{cluster['router_http_address']}/metrics", timeout=10).read().decode()
    return sum(float(v) for v in re.findall(r"^pdcluster:request_migrations_total\{[^}]*\} (\S+)$", text, re.M))


def _all_live(cluster: dict, n: int, timeout_s: float) -> None:
    reg = WorkerRegistry(cluster["redis_url"], cluster["cluster"])
    deadline = time.monotonic() + timeout_s
    while len(reg.live_workers()) < n:
        assert time.monotonic() < deadline, "workers not all back after the chaos"
        time.sleep(0.5)
    reg.close()


def test_every_request_completes_token_exact_under_chaos(cluster, tokenizer):
    work = _workload(tokenizer)
    with router_client(cluster, timeout_s=300) as client:
        def send(i: int) -> tuple[list[int], list[float]]:
            prompt, n = work[i]
            out: list[int] = []
            gaps: list[float] = []
            for msg in client.stream(prompt, max_tokens=n, temperature=0, ignore_eos=True, logprobs=2):
                out.extend(msg.token_ids)
                gaps.extend(lp.top[0].logprob - lp.top[1].logprob for lp in msg.logprobs if len(lp.top) > 1)
                time.sleep(0.02)  # a streaming client reading at its own pace: requests overlap the kills
            return out, gaps

        with ThreadPoolExecutor(6) as pool:
            refs = list(pool.map(send, range(len(work))))
        cfg = ChaosConfig(kill_every_s=6.0, jitter_s=1.0, redis_kill_at_s=3.0, seed=7)
        with ChaosMonkey(cluster["redis_url"], cluster["cluster"], cfg) as chaos, ThreadPoolExecutor(6) as pool:
            outputs = list(pool.map(send, range(len(work))))
    for i, ((ours, _), (ref, gaps)) in enumerate(zip(outputs, refs)):
        assert len(gaps) == len(ref), f"request {i}: no top-2 logprobs"
        assert_greedy_matches(ours, ref, gaps, f"request {i}")
    assert chaos.count("kill_worker") >= 2 and chaos.count("kill_redis") == 1, chaos.events
    assert _migrations(cluster) >= 1, "workers were killed mid-run but no request was migrated"
    _all_live(cluster, 4, 60)
    assert_no_leak(cluster, timeout_s=10)
