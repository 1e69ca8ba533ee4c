"""KV transfer failures through a real cluster (Ray + Redis + router + workers, real gRPC).

Faults come from the fault-injecting transport of ``tests/kv_faults.py`` (``--kv-transport
faulty --kv-transport-module tests.kv_faults``, around ``grpc``), loaded by every worker.

* A chunk corrupted in flight (``fault=corrupt``): under policy "error" the
  request ends with UNAVAILABLE naming the corrupt chunk and others are unaffected;
  under "recompute" the decode worker rebuilds the prompt's KV itself and the answer
  is token-exact against HF transformers (and a seeded one equals a colocated run).
* A prefill worker killed mid-transfer (``fault=delay`` holds every chunk, so transfers stay
  open), request migration off: the decode worker's reserved blocks come back within the
  lease + 1 s, the request ends with UNAVAILABLE and a new request is served token-exact.
* A stale replay: chunks of a finished transfer pushed again while another request
  decodes in its reused blocks are turned away ("stale:") and change nothing.

One small cluster per configuration (class-scoped, so only one runs at a time).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from kv_helpers import FAULTY_MODULE
from test_e2e import _mt_bench_first_turns

from engine.sampling import SamplingOptions
from kvtransfer import DEFAULT_MAX_CHUNK_BYTES, GrpcKvSender, KvTransferError
from kvtransfer.chunking import plan_chunks
from pdcluster.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from serving.registry import WorkerRegistry

from cluster_utils import (
    HfSteps,
    assert_greedy_matches,
    assert_no_leak,
    hf_greedy,
    render_chat,
    router_client,
    running_cluster,
    worker_channel,
    worker_connect,
    worker_loads,
)
from sched_helpers import _colocated, model  # noqa: F401 - fixture

BS = 16
SMALL = ("--block-size", str(BS), "--heartbeat-s", "0.5", "--max-num-seqs", "8")


def _faulty(fault: str, **options: str) -> tuple[str, ...]:
    """``up`` flags of the "faulty" KV transport around "grpc" with ``fault`` and ``options``."""
    flags = ["--kv-transport", "faulty", "--kv-transport-module", FAULTY_MODULE,
             "--kv-transport-option", f"fault={fault}"]
    for key, value in options.items():
        flags += ["--kv-transport-option", f"{key}={value}"]
    return tuple(flags)


def _client(state):
    return router_client(state, timeout_s=180, ready_s=60)


def _load(state, role: str) -> worker_pb2.WorkerLoad:
    """GetLoad of the one worker of ``role``, asked directly (not through the registry,
    which may still list a killed worker)."""
    (w,) = [w for w in state["workers"] if w["role"] == role]
    stub_cls = worker_pb2_grpc.DecodeWorkerStub if role == "decode" else worker_pb2_grpc.PrefillWorkerStub
    return stub_cls(worker_channel(state, w["address"])).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)


def _num_chunks(model_config, prompt_len: int, layers_per_chunk: int) -> int:
    """Chunks of one transfer of a ``prompt_len``-token prompt (float32 KV)."""
    per_layer_block = 2 * BS * model_config.num_kv_heads * model_config.head_dim * 4
    return len(plan_chunks(model_config.num_layers, -(-prompt_len // BS), per_layer_block, layers_per_chunk,
                           DEFAULT_MAX_CHUNK_BYTES))


def _hf_greedy_past_eos(hf_model, prompt_ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """HF transformers float32 greedy continuation of ``n`` tokens that, like a request
    with ``ignore_eos``, goes on past EOS (HF's own KV cache); and per step the gap between its
    top-2 logits."""
    hf, ids, gaps = HfSteps(hf_model, prompt_ids), [], []
    for _ in range(n):
        top2 = hf.logits.topk(2).values
        gaps.append(float(top2[0] - top2[1]))
        ids.append(int(hf.logits.argmax()))
        hf.append(ids[-1])
    return ids, gaps


def _wait_until(pred, timeout_s: float, what: str, poll_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(poll_s)


class TestCorruptChunkError:
    """Policy "error", one decode pool of 8 blocks; all 30 layers go in one chunk while
    they fit 4 MiB, so chunk 1 exists (and is corrupted) only for prompts of 6+ blocks."""

    LPC = 30

    @pytest.fixture(scope="class")
    def cluster(self, tmp_path_factory):
        with running_cluster(tmp_path_factory.mktemp("state"), *SMALL, "--max-model-len", "128",
                             "--num-kv-blocks", "9", "--kv-layers-per-chunk", str(self.LPC),
                             *_faulty("corrupt", chunk="1"), "--kv-failure-policy", "error") as state:
            yield state

    def test_corrupt_chunk_fails_only_its_request(self, cluster, model_config, hf_model, tokenizer):
        long_prompt = (tokenizer.encode("The history of the lighthouse keepers on the northern coast. ") * 12)[:90]
        shorts = [tokenizer.encode(f"Count slowly from {i} to {i + 9}:") for i in range(4)]
        assert _num_chunks(model_config, len(long_prompt), self.LPC) >= 2
        assert all(_num_chunks(model_config, len(p), self.LPC) == 1 for p in shorts)
        with _client(cluster) as client, ThreadPoolExecutor(5) as pool:
            bad = pool.submit(client.generate, long_prompt, max_tokens=4, temperature=0)
            good = [pool.submit(client.generate, p, max_tokens=8, temperature=0) for p in shorts]
            with pytest.raises(grpc.RpcError) as exc:
                bad.result(timeout=120)
            results = [f.result(timeout=120) for f in good]
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, exc.value
        msg = exc.value.details()
        assert "KV transfer failed" in msg and "corrupt" in msg and "checksum mismatch" in msg, msg
        for p, res in zip(shorts, results):
            ref, gaps = hf_greedy(hf_model, p, 8)
            assert_greedy_matches(res.token_ids, ref, gaps, label=tokenizer.decode(p))
        decode = _load(cluster, "decode")
        assert decode.num_failed_transfers >= 1 and decode.num_kv_recomputes == 0
        assert_no_leak(cluster)

    def test_stale_replay_after_reuse_is_dropped(self, cluster, model_config, hf_model, tokenizer):
        """Request A is driven straight through the workers (so its transfer id,
        generation and blocks are known); after it finished, request B (router)
        decodes in a pool where it must hold some of A's old blocks, and A's transfer
        is pushed again with junk KV: the decode worker answers "stale:" and B's
        output stays token-exact."""
        workers = {w["role"]: w for w in cluster["workers"]}
        decode = worker_pb2_grpc.DecodeWorkerStub(worker_channel(cluster, workers["decode"]["address"]))
        prefill = worker_pb2_grpc.PrefillWorkerStub(worker_channel(cluster, workers["prefill"]["address"]))
        text = "On the slow river the ferryman counted the lanterns of the sleeping town, one by one. "
        prompt_a = (tokenizer.encode(text) * 6)[:72]  # 5 blocks
        sampling = common_pb2.SamplingParams(max_tokens=4, temperature=0.0, top_p=1.0, ignore_eos=True,
                                             repetition_penalty=1.0)
        wreq = worker_pb2.WorkerRequest(request_id=f"stale-a-{uuid.uuid4().hex[:6]}", prompt_token_ids=prompt_a,
                                        sampling=sampling)
        tid = uuid.uuid4().hex
        events = decode.Reserve(worker_pb2.ReserveRequest(request=wreq, transfer_id=tid), timeout=120)
        dest = next(events).reservation
        assert len(dest.block_ids) == 5
        prefill.Prefill(worker_pb2.PrefillRequest(request=wreq, transfer_id=tid, destination=dest), timeout=120)
        tokens_a = [t for ev in events for t in ev.tokens.token_ids]
        ref_a, gaps_a = hf_greedy(hf_model, prompt_a, 4)
        assert_greedy_matches(tokens_a, ref_a, gaps_a, label="request A")
        assert_no_leak(cluster)

        prompt_b = (tokenizer.encode("A short note on how glaciers carve valleys over many thousands of years. ")
                    * 6)[:70]
        total = _load(cluster, "decode").num_total_blocks
        with _client(cluster) as client:
            stream = iter(client.stream(prompt_b, max_tokens=48, temperature=0, ignore_eos=True))
            got = []
            while not got:
                got += next(stream).token_ids
            held = total - _load(cluster, "decode").num_free_blocks
            assert held + len(dest.block_ids) > total, "B cannot share a block with A: the test proves nothing"
            junk = torch.full((model_config.num_layers, 2, 8, BS, model_config.num_kv_heads,
                               model_config.head_dim), 1.0e4)
            with pytest.raises(KvTransferError) as stale:
                GrpcKvSender(timeout_s=30, connect=worker_connect(cluster)).send(
                    wreq.request_id, tid, dest, junk, [1, 2, 3, 4, 5], 7, layers_per_chunk=model_config.num_layers)
            assert "stale:" in stale.value.reason, stale.value.reason
            for chunk in stream:
                got += chunk.token_ids
        ref_b, gaps_b = _hf_greedy_past_eos(hf_model, prompt_b, 48)
        assert_greedy_matches(got, ref_b, gaps_b, label="request B after the stale replay")
        assert_no_leak(cluster)


class TestCorruptChunkRecompute:
    """Policy "recompute": 15 chunks per transfer (2 layers each), chunk 1 of every
    transfer corrupted, so every request is rebuilt on the decode worker."""

    @pytest.fixture(scope="class")
    def cluster(self, tmp_path_factory):
        with running_cluster(tmp_path_factory.mktemp("state"), *SMALL, "--max-model-len", "384",
                             "--num-kv-blocks", "96", "--kv-layers-per-chunk", "2",
                             *_faulty("corrupt", chunk="1"), "--kv-failure-policy", "recompute") as state:
            yield state

    def test_recompute_on_decode_is_token_exact(self, cluster, hf_model, tokenizer):
        prompts = _mt_bench_first_turns(3)
        before = _load(cluster, "decode").num_kv_recomputes
        with _client(cluster) as client, ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda p: client.generate([{"role": "user", "content": p}], max_tokens=16,
                                                              temperature=0), prompts))
        for prompt, res in zip(prompts, results):
            ids = render_chat(tokenizer, [{"role": "user", "content": prompt}])
            ref, gaps = hf_greedy(hf_model, ids, 16)
            assert res.usage.prompt_tokens == len(ids)
            assert 0 <= res.usage.cached_prompt_tokens <= res.usage.prompt_tokens
            assert_greedy_matches(res.token_ids, ref, gaps, label=prompt[:40])
        decode = _load(cluster, "decode")
        assert decode.num_kv_recomputes - before == len(prompts), decode
        assert_no_leak(cluster)

    def test_recomputed_seeded_request_draws_like_a_colocated_run(self, cluster, model, model_config, tokenizer):
        """The decode worker samples the first token itself with the request's seed: the
        tokens equal one engine's prefill + decode with that seed (no draw skipped)."""
        ids = tokenizer.encode("Write a haiku about winter light.")
        sampling = SamplingOptions(temperature=0.8, seed=4321)
        _, want = _colocated(model, model_config, ids, 8, sampling)
        before = _load(cluster, "decode").num_kv_recomputes
        with _client(cluster) as client:
            res = client.generate(ids, max_tokens=8, temperature=0.8, seed=4321, ignore_eos=True)
        assert res.token_ids == want
        assert _load(cluster, "decode").num_kv_recomputes == before + 1
        assert_no_leak(cluster)


class TestPrefillKilledMidTransfer:
    """Policy "error", two prefill workers, every chunk delayed 0.15 s (15 chunks of 2
    layers: a transfer takes ~2.3 s), lease 4 s. The lease runs from the reservation
    (it is not renewed by arriving chunks), so it must outlast a whole healthy transfer.
    Request migration is off (``--max-migrations 0``): this checks what the decode side
    does with the lost transfer and the error the client then gets; a migrated request
    (resumed on the other prefill worker) is ``tests/test_e2e_migration.py``'s."""

    LEASE_S = 4.0
    DELAY_S = 0.15
    CHUNKS = 15

    @pytest.fixture(scope="class")
    def cluster(self, tmp_path_factory):
        with running_cluster(tmp_path_factory.mktemp("state"), *SMALL, "--prefill", "2", "--decode", "1",
                             "--max-model-len", "256", "--num-kv-blocks", "64", "--kv-layers-per-chunk", "2",
                             *_faulty("delay", delay_s=str(self.DELAY_S)), "--kv-lease-s", str(self.LEASE_S),
                             "--kv-failure-policy", "error", "--max-migrations", "0") as state:
            yield state

    def test_kill_prefill_worker_mid_transfer(self, cluster, hf_model, tokenizer):
        prompt = tokenizer.encode("Describe the water cycle in three sentences for a child.")
        outcome: dict = {}
        with _client(cluster) as client:
            def send():
                try:
                    outcome["result"] = client.generate(prompt, max_tokens=8, temperature=0)
                except grpc.RpcError as e:
                    outcome["error"] = e
                outcome["at"] = time.monotonic()

            t = threading.Thread(target=send)
            t.start()
            # the decode worker holds the reservation, and a prefill worker has the request
            _wait_until(lambda: (d := _load(cluster, "decode")).num_free_blocks < d.num_total_blocks,
                        60, "the decode reservation")
            victim = _wait_until(lambda: next((w.worker_id for w in worker_loads(cluster)
                                               if w.role == "prefill" and w.num_running), None),
                                 60, "the prefill worker holding the request")
            # chunk i leaves (i + 1) * DELAY_S after the last prefill step starts: kill
            # about halfway through the transfer (the outcome must not depend on where)
            time.sleep(self.CHUNKS * self.DELAY_S / 2)
            assert t.is_alive(), "the transfer finished before the kill"
            pid = next(w["pid"] for w in cluster["workers"] if w["worker_id"] == victim)
            os.kill(pid, signal.SIGKILL)
            t_kill = time.monotonic()
            d_total = _load(cluster, "decode").num_total_blocks
            _wait_until(lambda: _load(cluster, "decode").num_free_blocks == d_total, self.LEASE_S + 1.0,
                        "the decode worker's reserved blocks back in its pool")
            t.join(timeout=60)
            assert "error" in outcome, f"request survived its prefill worker: {outcome}"
            assert outcome["error"].code() == grpc.StatusCode.UNAVAILABLE, outcome["error"]
            assert outcome["at"] - t_kill < self.LEASE_S + 2.0
            # the registry drops the dead worker (key TTL 3 heartbeats), the router's view follows
            reg = WorkerRegistry(cluster["redis_url"], cluster["cluster"])
            # (by pid: Ray restarts the worker under the same id)
            _wait_until(lambda: (victim, pid) not in {(w.worker_id, w.pid) for w, _ in reg.live_workers()}, 10,
                        "the registry to drop the killed prefill worker")
            time.sleep(0.5)  # four refreshes of the router's registry view (heartbeat / 4)
            res = client.generate(prompt, max_tokens=8, temperature=0)
        ref, gaps = hf_greedy(hf_model, prompt, 8)
        assert_greedy_matches(res.token_ids, ref, gaps, label="after the kill")
        assert_no_leak(cluster)
