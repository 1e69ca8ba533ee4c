"""The main job end to end: client -> router -> prefill -> KV transfer -> decode,
placed by Ray, registered in Redis, checked token for token against HF transformers."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from loadtest.traces import default_traces_dir

from cluster_utils import (
    assert_greedy_matches,
    assert_no_leak,
    hf_greedy,
    hf_greedy_batch,
    render_chat,
    router_client,
    running_cluster,
)

MAX_MODEL_LEN = 512
PROMPTS = default_traces_dir() / "prompts"


def _mt_bench_first_turns(n: int) -> list[str]:
    path = PROMPTS / "mt_bench_question.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["turns"][0] for r in rows[:n]]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("state"), "--max-model-len", str(MAX_MODEL_LEN),
                         "--block-size", "16", "--num-kv-blocks", "600", "--heartbeat-s", "0.5") as state:
        yield state


@pytest.fixture(scope="module")
def client(cluster):
    with router_client(cluster) as c:
        yield c


@pytest.fixture(autouse=True)
def _leak_check(request):
    yield
    if "cluster" in request.fixturenames:
        assert_no_leak(request.getfixturevalue("cluster"))


def test_model_info(client):
    info = client.model_info()
    assert info.model_name == "smollm2-135m-instruct"
    assert info.max_model_len == MAX_MODEL_LEN
    assert info.vocab_size == 49152
    assert list(info.eos_token_ids) == [2]
    assert info.block_size == 16


def test_the_router_process_loads_no_torch(cluster):
    """The deployed router (a Ray actor process) maps no torch library: the layering contract
    holds for the process that runs, not only for the router's own modules."""
    maps = Path(f"/proc/{cluster['router_pid']}/maps").read_text()
    assert "libtorch" not in maps and "/torch/" not in maps


def test_mt_bench_token_exact(cluster, client, hf_model, tokenizer):
    """20 MT-Bench first turns, chat template, greedy, 32 new tokens, sent concurrently."""
    prompts = _mt_bench_first_turns(20)
    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(lambda p: client.generate([{"role": "user", "content": p}], max_tokens=32,
                                                          temperature=0), prompts))
    chats = [render_chat(tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    for prompt, ids, res, (ref, gaps) in zip(prompts, chats, results, hf_greedy_batch(hf_model, chats, 32)):
        assert res.usage.prompt_tokens == len(ids)
        assert_greedy_matches(res.token_ids, ref, gaps, label=prompt[:40])
        assert res.text == tokenizer.decode(res.token_ids, skip_special_tokens=True)
        assert res.finish_reason == ("STOP" if res.token_ids[-1] == 2 else "LENGTH")


@pytest.mark.parametrize("length", [1, 15, 16, 17, 31, 32, 33])
def test_raw_token_prompts_block_boundaries(client, hf_model, tokenizer, length):
    base = tokenizer.encode("Shall I compare thee to a summer's day? Thou art more lovely and more temperate: "
                            "Rough winds do shake the darling buds of May, And summer's lease hath all too short a date")
    ids = base[:length]
    res = client.generate(ids, max_tokens=12, temperature=0)
    ref, gaps = hf_greedy(hf_model, ids, 12)
    assert_greedy_matches(res.token_ids, ref, gaps, label=f"{length} tokens")
    assert res.usage.prompt_tokens == length


def test_max_tokens_one_equals_reference(client, hf_model, tokenizer):
    ids = render_chat(tokenizer, [{"role": "user", "content": "Name a primary color."}])
    res = client.generate([{"role": "user", "content": "Name a primary color."}], max_tokens=1, temperature=0)
    ref, _ = hf_greedy(hf_model, ids, 1)
    assert res.token_ids == ref and res.usage.completion_tokens == 1 and res.finish_reason == "LENGTH"


def test_sixteen_concurrent_match_alone(client):
    prompts = [f"Count from {i} to {i + 5}:" for i in range(16)]
    alone = [client.generate(p, max_tokens=8, temperature=0).token_ids for p in prompts[:4]]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda p: client.generate(p, max_tokens=8, temperature=0), prompts))
    assert all(len(r.token_ids) == 8 for r in together)
    assert [r.token_ids for r in together[:4]] == alone
    seeded_alone = client.generate(prompts[5], max_tokens=8, temperature=0.9, seed=1234).token_ids
    with ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(client.generate, p, max_tokens=8, temperature=0.9) for p in prompts[:7]]
        seeded = client.generate(prompts[5], max_tokens=8, temperature=0.9, seed=1234).token_ids
        [f.result() for f in futs]
    assert seeded == seeded_alone


def test_more_requests_than_server_threads_all_complete(client):
    """150 requests at once: more than the workers' 64 RPC threads and the decode batch.
    Waiting ``Reserve`` streams hold main-server threads; the KV transfers that complete
    them run on the decode worker's own KV server, so nothing times out."""
    prompts = [f"Say the number {i} in words:" for i in range(150)]
    alone = client.generate(prompts[0], max_tokens=4, temperature=0).token_ids
    with ThreadPoolExecutor(150) as pool:
        results = list(pool.map(lambda p: client.generate(p, max_tokens=4, temperature=0), prompts))
    assert all(1 <= len(r.token_ids) <= 4 for r in results)
    assert results[0].token_ids == alone


def test_stream_equals_non_stream_and_stop_strings(client):
    kwargs = dict(max_tokens=40, temperature=0)
    prompt = [{"role": "user", "content": "List three fruits, one per line."}]
    whole = client.generate(prompt, **kwargs)
    chunks = list(client.stream(prompt, **kwargs))
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert chunks[-1].usage.completion_tokens == len(whole.token_ids)
    assert all(c.finish_reason == 0 for c in chunks[:-1])
    # a stop string from the middle of that text: cut before it, finish STOP, never in the stream
    stop = whole.text[len(whole.text) // 2: len(whole.text) // 2 + 4]
    assert stop.strip()
    cut = whole.text[: whole.text.index(stop)]
    stopped = client.generate(prompt, stop=[stop], **kwargs)
    assert stopped.finish_reason == "STOP" and stopped.text == cut
    streamed = list(client.stream(prompt, stop=[stop], **kwargs))
    assert "".join(c.text for c in streamed) == cut
    assert streamed[-1].finish_reason == 1  # STOP


def test_logprobs_and_stop_token_ids(client):
    res = client.generate("The capital of France is", max_tokens=5, temperature=0, logprobs=3)
    assert len(res.logprobs) == len(res.token_ids) == 5
    for lp, tok in zip(res.logprobs, res.token_ids):
        assert lp.token_id == tok and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == tok  # greedy picks the top-1
    first = res.token_ids[1]
    res2 = client.generate("The capital of France is", max_tokens=5, temperature=0, stop_token_ids=[first])
    assert res2.token_ids == res.token_ids[:2] and res2.finish_reason == "STOP"


BAD = [
    (dict(prompt=""), "prompt"),
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(prompt="hi", temperature=-0.5), "temperature"),
    (dict(prompt="hi", top_p=0.0), "top_p"),
    (dict(prompt="hi", top_p=1.5), "top_p"),
    (dict(prompt="hi", top_k=-2), "top_k"),
    (dict(prompt=[5, 49152]), "vocab_size"),
    (dict(prompt=[7] * MAX_MODEL_LEN, max_tokens=1), "max_model_len"),
    (dict(prompt=[7] * (MAX_MODEL_LEN - 10), max_tokens=11), "max_model_len"),
    (dict(prompt="hi", temperature=float("nan")), "temperature"),
    (dict(prompt="hi", stop=["s"] * 17), "stop has 17 entries; at most 16"),
    (dict(prompt="x" * 200_000), "max_prompt_bytes"),
    (dict(prompt=[{"role": "user", "content": "x"}] * 257), "messages has 257 entries; at most 256"),
    (dict(prompt=[{"role": "robot", "content": "hi"}]), "is not a chat role"),
    (dict(prompt="hi", request_id="café"), "request_id must be"),
]


@pytest.mark.parametrize("kwargs,needle", BAD, ids=[n for _, n in BAD])
def test_bad_input_invalid_argument(client, kwargs, needle):
    prompt = kwargs.pop("prompt")
    with pytest.raises(grpc.RpcError) as exc:
        client.generate(prompt, **kwargs)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in exc.value.details()
    assert client.generate("Hello", max_tokens=2, temperature=0).usage.completion_tokens == 2


def test_prompt_at_exact_limit_is_accepted(client):
    res = client.generate([7] * (MAX_MODEL_LEN - 4), max_tokens=4, temperature=0, ignore_eos=True)
    assert len(res.token_ids) == 4 and res.finish_reason == "LENGTH"


def test_duplicate_request_id(client):
    stream = client.stream("Tell me a long story.", max_tokens=200, temperature=0, ignore_eos=True,
                           request_id="dup-1")
    next(iter(stream))
    with pytest.raises(grpc.RpcError) as exc:
        client.generate("Hello", max_tokens=2, request_id="dup-1")
    assert exc.value.code() == grpc.StatusCode.ALREADY_EXISTS
    stream.cancel()


def test_abort_stops_within_one_second(cluster, client):
    stream = client.stream("Tell me a long story.", max_tokens=400, temperature=0, ignore_eos=True,
                           request_id="abort-me")
    it = iter(stream)
    for _ in range(3):
        next(it)
    t0 = time.monotonic()
    assert client.abort("abort-me")
    rest = list(it)
    assert time.monotonic() - t0 < 1.0
    assert rest[-1].finish_reason == 3  # ABORT
    assert_no_leak(cluster, timeout_s=1.0)
    assert not client.abort("abort-me")


def test_client_disconnect_frees_blocks(cluster, client):
    stream = client.stream("Tell me a long story.", max_tokens=400, temperature=0, ignore_eos=True)
    it = iter(stream)
    for _ in range(3):
        next(it)
    stream.cancel()
    assert_no_leak(cluster, timeout_s=1.0)


def test_abort_while_queued_and_prefilling(cluster, client):
    """Cancel requests at once after sending (queued / prefilling / transferring). A request in the
    prefill step that is running lets go of its blocks when the step ends (a step is never cut
    short: tensor-parallel ranks run it in lockstep): ~0.8 s for this 300-token prompt at one
    thread on this 2-core machine, so the bound leaves room for a machine a few times slower."""
    streams = [client.stream([11] * 300, max_tokens=50, temperature=0) for _ in range(6)]
    threading.Event().wait(0.05)
    for s in streams:
        s.cancel()
    assert_no_leak(cluster, timeout_s=8.0)


@pytest.mark.parametrize("length", [63, 64, 65, 128])
def test_prefix_cache_second_send_is_a_hit(client, tokenizer, length):
    text = (PROMPTS / "sonnet.txt").read_text()
    offset = {63: 500, 64: 4000, 65: 8000, 128: 12000}[length]
    ids = tokenizer.encode(text[offset:])[:length]  # a prefix no other test sent
    first = client.generate(ids, max_tokens=8, temperature=0)
    second = client.generate(ids, max_tokens=8, temperature=0)
    assert first.token_ids == second.token_ids
    assert first.usage.cached_prompt_tokens == 0
    full = length // 16
    assert second.usage.cached_prompt_tokens == (full - (full * 16 == length)) * 16


def test_abort_storm_returns_every_pool_to_baseline(cluster, client):
    """100 requests aborted or cancelled at random moments (queued, prefilling,
    transferring, decoding): most on a timer from the request's start, whether or not a
    token came, one in five once it decodes. Every pool is back at its baseline once the
    prefill step in flight at the last stop has ended (a step is not interrupted: up to a
    2048-token budget, ~26 s on one thread of a slow 2-core machine before the panel GEMM's AVX2
    tile, ~0.6 of that since: bench/results/prefill_avx2.md), and the cluster still serves."""
    import random

    rng = random.Random(7)

    def one(i: int) -> int:
        rid = f"storm-{i}"
        prompt = [100 + (i * 13 + j) % 5000 for j in range(rng.choice([8, 40, 120, 300]))]
        stream = client.stream(prompt, max_tokens=64, temperature=0, ignore_eos=True, request_id=rid)
        delay = rng.choice([0.0, 0.01, 0.05, 0.2, 0.6, 1.2, 3.0, 8.0])
        stop = (lambda: client.abort(rid)) if i % 2 else stream.cancel
        decoding = i % 5 == 0  # its delay counts from its first token (at most 0.6 s: it stops mid-decode)
        timer = None if decoding else threading.Timer(delay, stop)
        if timer is not None:
            timer.start()
        tokens = 0
        try:
            for msg in stream:  # an abort ends it with ABORT, a cancel with CANCELLED; or it finished first
                tokens += len(msg.token_ids)
                if timer is None and tokens:
                    timer = threading.Timer(min(delay, 0.6), stop)
                    timer.start()
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.CANCELLED and not i % 2, (i, e)
        finally:
            if timer is not None:
                timer.cancel()
        return tokens

    with ThreadPoolExecutor(25) as pool:
        tokens = list(pool.map(one, range(100)))
    # stopped before their first token (queued or prefilling) and while decoding
    assert 0 in tokens and any(0 < t < 64 for t in tokens), tokens
    assert_no_leak(cluster, timeout_s=60.0)
    assert client.generate("Still serving?", max_tokens=3, temperature=0).usage.completion_tokens == 3
