"""Request migration on a real local cluster (Ray + Redis + router + 2 prefill + 2 decode
workers, real gRPC, ``kill -9``), KV failure policy "error" so that every failure reaches
the router.

* Eight greedy streams of 200 tokens and one seeded sampled stream (with penalties; 120): the
  decode worker serving the sampled one and about half of the greedy ones is killed
  mid-stream. Every stream completes with no error, and its tokens (no repeated or
  missing one) equal a fault-free run's (a greedy one but for a near tie that batch
  rounding may flip, as in every greedy check): each request resumed on the other decode
  worker from its prompt plus the tokens already streamed.
* Eight long prompts: a prefill worker is killed while it holds some of them (before
  their first token); they are retried on the other prefill worker and every answer
  equals a fault-free run's.

The tests wait for requests to reach a live worker only: whether the killed worker comes
back (restarted by the cluster) does not matter. Each ends with a leak check on every
worker the registry lists.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from serving.registry import WorkerRegistry

from cluster_utils import assert_greedy_matches, assert_no_leak, router_client, running_cluster, worker_loads

N_TOKENS = 200
TOPICS = ["rivers", "mountains", "lighthouses", "trains", "bees", "glaciers", "violins", "deserts"]
GREEDY = dict(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)  # top-2: near ties
# A different batch composition moves logits by float rounding (docs/sampling.md), which can
# flip a sampled token whose uniform draw lies within that rounding of a CDF boundary, like a
# greedy near-tie. These parameters and this seed keep every one of the 120 draws >= 1.3e-3
# away from a boundary (measured offline on a colocated run), so the comparison below checks
# the random stream's continuation, not rounding. Exactness at any k without rounding
# differences: tests/test_migration_resume.py.
SEEDED = dict(max_tokens=120, temperature=0.7, top_k=8, top_p=0.95, seed=4242, ignore_eos=True,
              repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3)
SEEDED_PROMPT = "Invent a fairy tale about a clockmaker."


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("state"), "--prefill", "2", "--decode", "2",
                         "--max-model-len", "1024", "--num-kv-blocks", "400", "--max-num-seqs", "16",
                         "--heartbeat-s", "0.5", "--kv-failure-policy", "error") as state:
        yield state


@pytest.fixture(scope="module")
def client(cluster):
    with router_client(cluster, timeout_s=180) as c:
        yield c


class _Stream(threading.Thread):
    """Consumes one streaming request; ``tokens`` grows as messages arrive."""

    def __init__(self, client, prompt: str, sampling: dict) -> None:
        super().__init__(daemon=True)
        self.call = client.stream(prompt, **sampling)
        self.tokens: list[int] = []
        self.gaps: list[float] = []  # top-2 logprob gap per token (with logprobs=2)
        self.error: grpc.RpcError | None = None
        self.usage = None

    def run(self) -> None:
        try:
            for msg in self.call:
                self.tokens.extend(msg.token_ids)
                self.gaps.extend(lp.top[0].logprob - lp.top[1].logprob for lp in msg.logprobs if len(lp.top) > 1)
                if msg.finish_reason:
                    self.usage = msg.usage
        except grpc.RpcError as e:
            self.error = e


def _start(client, prompt: str, sampling: dict) -> _Stream:
    s = _Stream(client, prompt, sampling)
    s.start()
    return s


def _wait(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (got := pred()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.02)
    return got


def _kill(cluster: dict, worker_id: str) -> None:
    """``kill -9`` of the live process of ``worker_id`` (its pid from the registry)."""
    live = WorkerRegistry(cluster["redis_url"], cluster["cluster"]).live_workers()
    os.kill(next(w.pid for w, _ in live if w.worker_id == worker_id), signal.SIGKILL)


def _migrations(cluster: dict, role: str) -> float:
    with urllib.request.urlopen(f"http://{cluster['router_http_address']}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.search(r'^pdcluster:request_migrations_total\{[^}]*failed_role="' + role + r'"[^}]*\} (\S+)$',
                      text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _no_leak_on_listed_workers(cluster: dict) -> None:
    """Once every worker the registry lists answers (the dead one dropped out or came back),
    no blocks are held anywhere."""
    def answered():
        try:
            return worker_loads(cluster)
        except grpc.RpcError:
            return None
    _wait(answered, 30, "every listed worker to answer")
    assert_no_leak(cluster, timeout_s=5.0)


def test_decode_worker_killed_mid_stream(cluster, client):
    ref_seeded = _start(client, SEEDED_PROMPT, SEEDED)
    refs = [_start(client, f"Write a long essay about {t}.", GREEDY) for t in TOPICS]
    for s in [ref_seeded, *refs]:
        s.join(120)
        assert s.error is None and len(s.tokens) == s.usage.completion_tokens, (s.error, len(s.tokens))
    before = _migrations(cluster, "decode")

    seeded = _start(client, SEEDED_PROMPT, SEEDED)
    _wait(lambda: len(seeded.tokens) >= 1, 60, "the seeded stream's first token")
    victim = next(w.worker_id for w in worker_loads(cluster) if w.role == "decode" and w.num_running)
    streams = [_start(client, f"Write a long essay about {t}.", GREEDY) for t in TOPICS]
    _wait(lambda: all(len(s.tokens) >= 25 for s in streams), 90, "25 tokens on every stream")
    # on a loaded machine a busy worker's registry record can lapse for a heartbeat: wait for it to be listed
    on_victim, = _wait(lambda: next(((w.num_running,) for w in worker_loads(cluster) if w.worker_id == victim), None),
                       10, f"{victim} to be listed")
    assert 2 <= on_victim <= 7, f"victim {victim} serves {on_victim} of 9 streams"
    assert len(seeded.tokens) < SEEDED["max_tokens"] and all(len(s.tokens) < N_TOKENS for s in streams)
    _kill(cluster, victim)

    for s in [seeded, *streams]:
        s.join(150)
        assert not s.is_alive(), "a stream hung after the kill"
        assert s.error is None, f"a stream failed: {s.error}"
        assert s.usage.completion_tokens == len(s.tokens)
    for i, (s, ref) in enumerate(zip(streams, refs)):
        # token-exact, but for a near tie (< 1e-2) that batch rounding may flip, as everywhere
        assert len(ref.gaps) == N_TOKENS
        assert_greedy_matches(s.tokens, ref.tokens, ref.gaps, label=f"greedy stream {i} ({TOPICS[i]}) after the kill")
    assert seeded.tokens == ref_seeded.tokens, "the seeded stream did not continue its random stream"
    assert _migrations(cluster, "decode") - before == on_victim
    _no_leak_on_listed_workers(cluster)


def test_prefill_worker_killed_before_the_first_token(cluster, client):
    prompts = [[(1000 + 97 * i + 13 * j) % 40000 + 100 for j in range(500)] for i in range(8)]
    before = _migrations(cluster, "prefill")
    with ThreadPoolExecutor(len(prompts)) as pool:
        futs = [pool.submit(client.generate, p, max_tokens=8, temperature=0.0) for p in prompts]
        victim = _wait(lambda: next((w.worker_id for w in worker_loads(cluster)
                                     if w.role == "prefill" and (w.num_running or w.num_waiting)), None),
                       60, "a prefill worker holding requests")
        _kill(cluster, victim)
        results = [f.result(timeout=120) for f in futs]
        assert _migrations(cluster, "prefill") - before >= 1, "no request was on the killed prefill worker"
        again = list(pool.map(lambda p: client.generate(p, max_tokens=8, temperature=0.0), prompts))
    assert [list(r.token_ids) for r in results] == [list(r.token_ids) for r in again]
    _no_leak_on_listed_workers(cluster)
