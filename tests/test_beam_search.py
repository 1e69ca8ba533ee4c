"""vLLM's ``use_beam_search``: the search itself (router/beam_search.py), the requests it refuses, and the whole
path on a real cluster against the same search over HF ``transformers`` float32 log-probabilities."""

from __future__ import annotations

import math

import openai
import pytest
import torch

from router.beam_search import Beam, BeamSearch
from router.openai.beam import MAX_BEAM_WIDTH, check_beam_request, wants_beam_search
from router.openai.chat import chat_requests
from router.openai.protocol import ChatCompletionRequest, CompletionRequest
from router.openai.requests import OpenAIRequestError, completion_requests

from cluster_utils import assert_no_leak, render_chat, running_cluster

EOS = 9
TABLE = {  # last token -> its next tokens' probabilities (a toy model)
    0: {1: 0.5, 2: 0.4, EOS: 0.1}, 1: {EOS: 0.9, 3: 0.1}, 2: {4: 1.0}, 3: {EOS: 1.0}, 4: {5: 0.6, EOS: 0.4},
    5: {EOS: 1.0},
}


def _toy(seqs: list[list[int]], k: int) -> list[list[tuple[int, float]]]:
    return [sorted(((t, math.log(p)) for t, p in TABLE[s[-1]].items()), key=lambda x: -x[1])[:k] for s in seqs]


def test_the_search_keeps_the_best_beams_and_scores_as_vllm():
    """Beams grow by every candidate and the width best continue; EOS ends a beam; the score is the summed
    logprob over the length (prompt included, EOS not) to the length_penalty."""
    got = BeamSearch(2, 5, frozenset({EOS}), length_penalty=1.0).run([0], _toy)
    assert [b.tokens for b in got] == [(0, 2, 4, 5, EOS), (0, 1, EOS)]  # the longer one: a better mean
    assert all(b.finish_reason == "stop" for b in got)
    assert got[1].cum_logprob == pytest.approx(math.log(0.5 * 0.9))
    assert got[1].score(1.0, frozenset({EOS})) == pytest.approx(math.log(0.45) / 2)
    assert got[0].score(1.0, frozenset({EOS})) == pytest.approx(math.log(0.4 * 0.6) / 4)
    cut = BeamSearch(1, 2, frozenset({EOS}), length_penalty=0.0).run([0], _toy)
    assert cut == [Beam((0, 1, EOS), math.log(0.5) + math.log(0.9), "stop")]
    assert BeamSearch(1, 1, frozenset({EOS}), ignore_eos=True).run([0], _toy)[0].tokens == (0, 1)
    assert BeamSearch(3, 9, frozenset({EOS}), max_len=3).run([0], _toy)[-1].finish_reason == "length"
    with pytest.raises(ValueError):
        BeamSearch(0, 5, frozenset())
    for penalty in (200.0, -250.0, 1e308):  # ranked in log space: no overflow, the same order as the scores
        ranked = BeamSearch(3, 5, frozenset({EOS}), length_penalty=penalty).run([0], _toy)
        assert len(ranked) == 3 and ranked[0].finish_reason == "stop"


BAD = [
    (dict(stream=True), "stream"), (dict(n=MAX_BEAM_WIDTH + 1), "n"), (dict(logprobs=1), "logprobs"),
    (dict(stop=["."]), "stop"), (dict(top_p=0.5), "top_p"), (dict(presence_penalty=1.0), "presence_penalty"),
    (dict(echo=True), "echo"), (dict(length_penalty="long"), "length_penalty"),
    (dict(structured_outputs={"regex": "a"}), "structured_outputs"), (dict(use_beam_search=1), "use_beam_search"),
    (dict(length_penalty=10 ** 400), "length_penalty"), (dict(top_k=5), "top_k"),
]


@pytest.mark.parametrize("extra,param", BAD)
def test_what_would_change_a_beam_search_is_refused_naming_the_field(extra, param):
    body = CompletionRequest.model_validate({"prompt": "a", "use_beam_search": True, **extra})
    with pytest.raises(OpenAIRequestError) as e:
        _, subs = completion_requests(body)
        if wants_beam_search(body):
            check_beam_request(body, subs)
    assert e.value.param == param, e.value.message


def test_neutral_fields_and_tool_choice_none_pass():
    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "a"}], "use_beam_search": True, "n": 3, "temperature": 0.7,
        "seed": 1, "top_p": 1.0, "top_k": -1, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"})
    _, subs = chat_requests(body)
    assert wants_beam_search(body) and check_beam_request(body, subs) == 1.0
    body = ChatCompletionRequest.model_validate({**body.model_dump(), "tool_choice": "required"})
    with pytest.raises(OpenAIRequestError, match="tool calling is not served"):
        check_beam_request(body, chat_requests(body)[1])


def test_a_width_the_router_cannot_hold_is_refused_and_searches_are_bounded():
    """n above the router's capacity can never run: 400 n, before any step; past MAX_BEAM_SEARCHES searches at once
    the next is refused with 429 at once rather than queued out of sight."""
    import threading
    from types import SimpleNamespace

    import grpc

    from router.errors import RouterError
    from router.openai import beam
    core = SimpleNamespace(admission=SimpleNamespace(capacity=lambda: 5))
    with pytest.raises(OpenAIRequestError, match="n 8 beams exceed the 5 requests") as e:
        beam.start_search(core, [], 8, 1.0, frozenset(), threading.Event())
    assert e.value.param == "n"
    taken = [beam._SLOTS.acquire(blocking=False) for _ in range(beam.MAX_BEAM_SEARCHES)]
    try:
        with pytest.raises(RouterError) as e:
            beam.start_search(core, [], 2, 1.0, frozenset(), threading.Event())
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.retry_after_ms
    finally:
        for ok in taken:
            if ok:
                beam._SLOTS.release()


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("state"), "--max-model-len", "256", "--block-size", "16",
                         "--num-kv-blocks", "64", "--heartbeat-s", "0.5") as state:
        yield state


def _hf_step(hf_model):
    def step(seqs: list[list[int]], k: int) -> list[list[tuple[int, float]]]:
        out = []
        with torch.no_grad():
            for seq in seqs:
                logprobs = torch.log_softmax(hf_model(torch.tensor([seq])).logits[0, -1].float(), -1)
                values, ids = logprobs.topk(k)
                out.append(list(zip(ids.tolist(), values.tolist())))
        return out
    return step


def test_beam_search_end_to_end(state, tokenizer, hf_model, model_config):
    """Completions (two prompts, width 3) and chat (width 2, length_penalty 0.5) through prefill and decode
    workers give the beams the same search finds over HF float32 log-probabilities, best first; nothing leaks."""
    eos = frozenset(model_config.eos_token_ids)
    step = _hf_step(hf_model)

    def expected(prompt_ids, width, max_tokens, penalty=1.0):
        beams = BeamSearch(width, max_tokens, eos, length_penalty=penalty, max_len=256).run(prompt_ids, step)
        return [(tokenizer.decode(b.tokens[len(prompt_ids):len(b.tokens) - (b.finish_reason == "stop")],
                                  skip_special_tokens=True), b.finish_reason) for b in beams]

    with openai.OpenAI(base_url=f"http://{state['router_http_address']}/v1", api_key="unused", max_retries=0,
                       timeout=300) as oai:
        prompts = ["The capital of France is", "Water boils at"]
        got = oai.completions.create(model="", prompt=prompts, max_tokens=8, n=3, temperature=0.8,
                                     extra_body={"use_beam_search": True})
        want = [x for p in prompts for x in expected(tokenizer.encode(p), 3, 8)]
        assert [(c.text, c.finish_reason) for c in sorted(got.choices, key=lambda c: c.index)] == want
        assert got.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
        messages = [{"role": "user", "content": "Say hi"}]
        chat = oai.chat.completions.create(model="", messages=messages, max_tokens=10, n=2,
                                           extra_body={"use_beam_search": True, "length_penalty": 0.5})
        assert [(c.message.content, c.finish_reason) for c in chat.choices] == \
            expected(render_chat(tokenizer, messages), 2, 10, 0.5)
        with pytest.raises(openai.BadRequestError, match="stream is not served"):
            oai.completions.create(model="", prompt="a", stream=True, extra_body={"use_beam_search": True})
        with pytest.raises(openai.BadRequestError) as e:  # named as on the request path
            oai.completions.create(model="", prompt="a", temperature=-1.0, extra_body={"use_beam_search": True})
        assert e.value.body["param"] == "temperature", e.value.body
        long = oai.completions.create(model="", prompt="one two " * 20, max_tokens=2, n=2,
                                      extra_body={"use_beam_search": True, "length_penalty": 200})
        assert len(long.choices) == 2
    assert_no_leak(state)
