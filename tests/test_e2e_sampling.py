"""The new sampling knobs, vLLM's chat options and structured outputs end to end: client -> router (validation) ->
prefill worker (first token) -> KV transfer -> decode worker (the rest), on a real local cluster."""

from __future__ import annotations

import json
import re
import urllib.request

import grpc
import openai
import pytest
import torch
import xgrammar as xgr

from engine.bad_words import banned_next
from pdcluster.cli import main as cli_main
from pdcluster.client import PdclusterClient
from router.limits import Limits
from router.validation import RequestValidator

from cluster_utils import assert_greedy_matches, assert_no_leak, hf_constrained_greedy, hf_greedy, running_cluster

VOCAB = 49152
LOOP_PROMPT = "one two three one two three one two three one two three"

BAD = [
    (dict(min_p=1.5), "sampling.min_p must be in [0, 1]"),
    (dict(min_p=-0.25), "sampling.min_p must be in [0, 1]"),
    (dict(repetition_penalty=0.0), "sampling.repetition_penalty must be > 0"),
    (dict(presence_penalty=2.5), "sampling.presence_penalty must be in [-2, 2]"),
    (dict(frequency_penalty=-3.0), "sampling.frequency_penalty must be in [-2, 2]"),
    (dict(logit_bias={VOCAB: 1.0}), f"sampling.logit_bias: token id {VOCAB} >= vocab_size {VOCAB}"),
    (dict(logit_bias={5: 150.0}), "sampling.logit_bias[5] must be in [-100, 100]"),
]


def _repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("state"), "--max-model-len", "256", "--block-size", "16",
                         "--num-kv-blocks", "64", "--heartbeat-s", "0.5") as state:
        yield state


def test_sampling_knobs_end_to_end(state, tokenizer, hf_model):
    with PdclusterClient(state["router_address"], timeout_s=300) as client:
        client.wait_ready(30)
        # logit_bias forces a token on both workers (first token: prefill; the rest: decode),
        # greedy and sampled; logprobs stay those of the raw model distribution (< 0).
        forced = tokenizer.encode(" banana", add_special_tokens=False)[0]
        for kwargs in (dict(temperature=0), dict(temperature=1.0, seed=3, top_k=5, min_p=0.1)):
            res = client.generate("Name a colour:", max_tokens=5, ignore_eos=True, logprobs=1,
                                  logit_bias={forced: 100.0}, **kwargs)
            assert res.token_ids == [forced] * 5, kwargs
            assert all(lp.logprob < 0 for lp in res.logprobs)
        # penalties: the plain greedy loop repeats; presence / frequency (output tokens, decode
        # side history) and repetition (prompt + output) penalties repeat less.
        plain = client.generate(LOOP_PROMPT, max_tokens=16, temperature=0, ignore_eos=True).token_ids
        pen = client.generate(LOOP_PROMPT, max_tokens=16, temperature=0, ignore_eos=True,
                              presence_penalty=0.5, frequency_penalty=1.0).token_ids
        rep = client.generate(LOOP_PROMPT, max_tokens=16, temperature=0, ignore_eos=True,
                              repetition_penalty=1.5).token_ids
        assert _repeats(plain) >= 6, tokenizer.decode(plain)
        assert _repeats(pen) < _repeats(plain) and _repeats(rep) < _repeats(plain)
        # streamed with penalties equals non-streamed
        chunks = list(client.stream(LOOP_PROMPT, max_tokens=16, temperature=0, ignore_eos=True,
                                    presence_penalty=0.5, frequency_penalty=1.0))
        assert [t for c in chunks for t in c.token_ids] == pen
        # every new field is validated by the router, naming the field
        for kwargs, needle in BAD:
            with pytest.raises(grpc.RpcError) as exc:
                client.generate("hi", max_tokens=2, **kwargs)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kwargs
            assert needle in exc.value.details(), (kwargs, exc.value.details())
        assert client.generate("Hello", max_tokens=2, temperature=0).usage.completion_tokens == 2
        _min_tokens(client, hf_model, tokenizer)
    assert_no_leak(state)


def _min_tokens(client, hf_model, tokenizer) -> None:
    """vLLM's ``min_tokens`` against HF's ``min_new_tokens`` (the same ban of EOS): a prompt whose greedy
    answer is EOS at once runs ``min_tokens`` tokens first (the first banned on the prefill worker, the
    rest on the decode worker); a stop token id waits too; a stop string completed before the minimum
    is text; more than ``max_tokens`` is refused naming the field."""
    prompt = "Write a long story about dragon number 1."
    assert client.generate(prompt, max_tokens=8, temperature=0).token_ids == [2]  # EOS at once
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=12, min_new_tokens=6, do_sample=False, pad_token_id=2)
    ref = out[0, len(ids):].tolist()
    ours = client.generate(prompt, max_tokens=12, min_tokens=6, temperature=0)
    assert ours.token_ids == ref and len(ref) >= 6, (ours.token_ids, ref)
    first = ours.token_ids[0]
    banned = client.generate(prompt, max_tokens=12, min_tokens=3, temperature=0, ignore_eos=True,
                             stop_token_ids=[first], logit_bias={first: 100.0})
    # banned while fewer than 3 tokens exist (as HF's min_new_tokens): the 4th may end it
    assert len(banned.token_ids) == 4 and first not in banned.token_ids[:3], banned.token_ids
    word = tokenizer.decode(ref[:1])
    late = client.generate(prompt, max_tokens=12, min_tokens=6, temperature=0, stop=[word])
    assert word in late.text and late.usage.completion_tokens >= 6, late
    with pytest.raises(grpc.RpcError) as exc:
        client.generate(prompt, max_tokens=4, min_tokens=5)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.details() == "sampling.min_tokens must be <= max_tokens (4), got 5"


ANSWER_START = [{"role": "user", "content": "Name three rivers in Europe."},
                {"role": "assistant", "content": "The three rivers are the Danube,"}]


def test_chat_options_end_to_end(state, tokenizer, hf_model):
    """vLLM's ``continue_final_message`` through both front doors: the model continues the partial
    answer, token-exact with HF on HF's own rendering; ``/tokenize`` counts the same prompt; a bad
    template variable is a 400 / INVALID_ARGUMENT naming it."""
    prompt = tokenizer.encode(tokenizer.apply_chat_template(ANSWER_START, continue_final_message=True, tokenize=False),
                              add_special_tokens=False)
    ref, gaps = hf_greedy(hf_model, prompt, 8)
    options = {"add_generation_prompt": False, "continue_final_message": True}
    with PdclusterClient(state["router_address"], timeout_s=300) as client:
        res = client.generate(ANSWER_START, chat_options=options, max_tokens=8, temperature=0, ignore_eos=True)
        assert_greedy_matches(res.token_ids, ref, gaps, "gRPC continue_final_message")
        assert res.usage.prompt_tokens == len(prompt)
        with pytest.raises(grpc.RpcError) as exc:
            client.generate(ANSWER_START, chat_options={"chat_template_kwargs": {"tokenize": True}}, max_tokens=2)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "chat_template_kwargs.tokenize" in \
            exc.value.details()
        assert len(dict(exc.value.trailing_metadata())["x-request-id"]) == 32  # minted, so the log names it
    base = f"http://{state['router_http_address']}"
    body = {"messages": ANSWER_START, **options}
    post = urllib.request.Request(f"{base}/tokenize", data=json.dumps(body).encode(),
                                  headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(post, timeout=60) as r:
        assert json.loads(r.read())["tokens"] == prompt
    with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300) as oai:
        answer = oai.chat.completions.create(model="", messages=ANSWER_START, max_tokens=8, temperature=0,
                                             extra_body={**options, "ignore_eos": True,
                                                         "chat_template_kwargs": {"unused": 1}})
        assert answer.choices[0].message.content == tokenizer.decode(res.token_ids, skip_special_tokens=True)
        assert answer.usage.prompt_tokens == len(prompt)
        user_turn = oai.chat.completions.create(model="", messages=[{"role": "user", "content": "The sky is"}],
                                                max_tokens=2, extra_body=options)
        assert user_turn.choices[0].message.role == "user"  # vLLM names the continued message's role
        with pytest.raises(openai.BadRequestError) as bad:
            oai.chat.completions.create(model="", messages=ANSWER_START, max_tokens=2,
                                        extra_body={"continue_final_message": True})
        assert bad.value.body["param"] == "continue_final_message", bad.value.body
    assert_no_leak(state)


def test_allowed_token_ids_end_to_end(state, tokenizer, hf_model):
    """vLLM's ``allowed_token_ids`` on both workers (first token: prefill; the rest: decode) and both
    front doors, token-exact with HF's greedy choice among the allowed ids."""
    prompt = "The colours of the flag are"
    allowed = sorted({tokenizer.encode(w, add_special_tokens=False)[0] for w in (" red", " green", " blue", " and")})
    ids = tokenizer.encode(prompt)
    ref = []
    with torch.no_grad():
        for _ in range(6):
            logits = hf_model(torch.tensor([ids + ref])).logits[0, -1]
            ref.append(allowed[int(logits[allowed].argmax())])
    with PdclusterClient(state["router_address"], timeout_s=300) as client:
        res = client.generate(prompt, allowed_token_ids=allowed, max_tokens=6, temperature=0, ignore_eos=True)
        assert res.token_ids == ref, (res.token_ids, ref)
        sampled = client.generate(prompt, allowed_token_ids=allowed, max_tokens=6, temperature=1.0, seed=5)
        assert set(sampled.token_ids) <= set(allowed), sampled.token_ids
    with openai.OpenAI(base_url=f"http://{state['router_http_address']}/v1", api_key="unused", max_retries=0,
                       timeout=300) as oai:
        answer = oai.completions.create(model="", prompt=prompt, max_tokens=6, temperature=0,
                                        extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
        assert answer.choices[0].text == tokenizer.decode(ref)
        with pytest.raises(openai.BadRequestError) as bad:
            oai.completions.create(model="", prompt=prompt, max_tokens=2, extra_body={"allowed_token_ids": [VOCAB]})
        assert bad.value.body["param"] == "allowed_token_ids", bad.value.body
    assert_no_leak(state)


def test_truncate_prompt_tokens_end_to_end(state, tokenizer):
    """vLLM's ``truncate_prompt_tokens``: a prompt longer than the context is served from its last k
    tokens, as the same k tokens sent as ids are."""
    text = " ".join(f"item {i}," for i in range(150))
    ids = tokenizer.encode(text)
    assert len(ids) > 256
    with openai.OpenAI(base_url=f"http://{state['router_http_address']}/v1", api_key="unused", max_retries=0,
                       timeout=300) as oai:
        cut = oai.completions.create(model="", prompt=text, max_tokens=6, temperature=0,
                                     extra_body={"truncate_prompt_tokens": 40, "ignore_eos": True})
        same = oai.completions.create(model="", prompt=ids[-40:], max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert cut.choices[0].text == same.choices[0].text and cut.usage.prompt_tokens == 40
        with pytest.raises(openai.BadRequestError) as bad:
            oai.completions.create(model="", prompt=text, max_tokens=2, extra_body={"truncate_prompt_tokens": 0})
        assert bad.value.body["param"] == "truncate_prompt_tokens", bad.value.body
    assert_no_leak(state)


def test_skip_special_tokens_end_to_end(state, tokenizer):
    """vLLM's ``skip_special_tokens`` false: a special token the model samples (forced here by
    ``logit_bias``, on both workers) is text on both front doors; by default it is left out."""
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    with PdclusterClient(state["router_address"], timeout_s=300) as client:
        kwargs = dict(max_tokens=3, temperature=0, ignore_eos=True, logit_bias={start: 100.0})
        assert client.generate("Hi", **kwargs).text == ""
        shown = client.generate("Hi", skip_special_tokens=False, **kwargs)
        assert shown.token_ids == [start] * 3 and shown.text == "<|im_start|>" * 3
    with openai.OpenAI(base_url=f"http://{state['router_http_address']}/v1", api_key="unused", max_retries=0,
                       timeout=300) as oai:
        answer = oai.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                             temperature=0, logit_bias={str(start): 100},
                                             extra_body={"skip_special_tokens": False, "ignore_eos": True})
        assert answer.choices[0].message.content == "<|im_start|>" * 3
    assert_no_leak(state)


def test_return_tokens_as_token_ids(state, tokenizer):
    """vLLM's ``return_tokens_as_token_ids``: logprobs name each token ``token_id:<id>`` (chat and
    completions, top entries too); completions' ``text_offset`` is what it is without the option."""
    base = f"http://{state['router_http_address']}/v1"
    with openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300) as oai:
        plain = oai.completions.create(model="", prompt="Once upon", max_tokens=4, temperature=0, logprobs=2,
                                       extra_body={"ignore_eos": True})
        ids = oai.completions.create(model="", prompt="Once upon", max_tokens=4, temperature=0, logprobs=2,
                                     extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        got, ref = ids.choices[0].logprobs, plain.choices[0].logprobs
        tokens = [int(t.removeprefix("token_id:")) for t in got.tokens]
        assert [tokenizer.decode([t]) for t in tokens] == ref.tokens and got.text_offset == ref.text_offset
        assert all(k.startswith("token_id:") for top in got.top_logprobs for k in top)
        chat = oai.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                           logprobs=True, top_logprobs=1,
                                           extra_body={"return_tokens_as_token_ids": True})
        entry = chat.choices[0].logprobs.content[0]
        assert entry.token.startswith("token_id:") and entry.top_logprobs[0].token.startswith("token_id:")
    assert_no_leak(state)


def test_a_request_id_that_could_forge_log_lines_is_refused_under_a_minted_one(state):
    """A client's id with a newline (it would write a line of its own into the router's log): refused
    naming ``request_id``, the id shown escaped, the refusal answered and logged under a minted id."""
    forged = "x\n2026-12-05 23:59:59,000 INFO router.core FORGED"
    with PdclusterClient(state["router_address"], timeout_s=60) as client:
        with pytest.raises(grpc.RpcError) as exc:
            client.generate("hi", max_tokens=2, request_id=forged)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.details().startswith("request_id must be at most 256 printable ASCII characters") and \
        "\\n" in exc.value.details() and "\n" not in exc.value.details()
    minted = dict(exc.value.trailing_metadata())["x-request-id"]
    assert len(minted) == 32 and minted != forged


def test_structured_outputs_end_to_end(state, tokenizer, hf_model, model_config, capsys):
    """vLLM's structured outputs on both workers (first token: prefill; the rest: decode) and both front
    doors and the CLI: greedy is token-exact with HF under xgrammar's mask; every kind's output is in its language;
    what does not compile is refused naming the field, on both doors; nothing leaks."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model_config.vocab_size,
                                              stop_token_ids=list(model_config.eos_token_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    prompt = "A person described as JSON with a name and an age:"
    ids = tokenizer.encode(prompt)
    ref, gaps = hf_constrained_greedy(hf_model, tokenizer, model_config, ids,
                                       compiler.compile_json_schema(json.dumps(schema)), 40)
    with PdclusterClient(state["router_address"], timeout_s=300) as client:
        res = client.generate(prompt, structured_outputs={"json": schema}, max_tokens=40, temperature=0)
        assert_greedy_matches(res.token_ids, ref, gaps, "json schema")
        if res.finish_reason == "STOP":
            answer = json.loads(res.text)
            assert isinstance(answer["name"], str) and isinstance(answer["age"], int), res.text
        digits = client.generate("Call me at", structured_outputs={"regex": r" \d{3}-\d{4}"}, max_tokens=12,
                                 temperature=1.0, seed=3)
        assert re.fullmatch(r" \d{3}-\d{4}", digits.text) and digits.finish_reason == "STOP", digits
        with pytest.raises(grpc.RpcError) as bad:
            client.generate("x", structured_outputs={"regex": "("}, max_tokens=2)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "structured_outputs.regex does not compile" in bad.value.details(), bad.value.details()
    assert cli_main(["generate", "--address", state["router_address"], "--temperature", "0", "--structured-outputs",
                     '{"choice": [" left", " right"]}', "Turn"]) == 0
    assert capsys.readouterr().out in (" left\n", " right\n")
    with openai.OpenAI(base_url=f"http://{state['router_http_address']}/v1", api_key="unused", max_retries=0,
                       timeout=300) as oai:
        picked = oai.completions.create(model="", prompt="Is the sky blue? Answer:", max_tokens=8, temperature=0,
                                        extra_body={"structured_outputs": {"choice": [" yes", " no", " maybe"]}})
        assert picked.choices[0].text in (" yes", " no", " maybe") and picked.choices[0].finish_reason == "stop"
        chat = oai.chat.completions.create(
            model="", messages=[{"role": "user", "content": "Is water wet? Reply in JSON."}], max_tokens=24,
            temperature=1.0, seed=11, response_format={"type": "json_schema", "json_schema": {
                "name": "answer", "schema": {"type": "object", "properties": {"wet": {"type": "boolean"}},
                                             "required": ["wet"]}}},
            extra_body={"structured_outputs": None})
        assert json.loads(chat.choices[0].message.content)["wet"] in (True, False), chat
        with pytest.raises(openai.BadRequestError) as bad:
            oai.chat.completions.create(model="", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                        response_format={"type": "json_schema", "json_schema": {
                                            "name": "x", "schema": {"type": "bogus"}}})
        assert bad.value.body["param"] == "response_format", bad.value.body
        assert bad.value.body["message"].startswith("response_format.json_schema.schema does not compile: "
                                                    "Unsupported type"), bad.value.body
    assert_no_leak(state)


def test_prompt_logprobs_and_echo_end_to_end(state, tokenizer, hf_model):
    """vLLM's ``prompt_logprobs`` (gRPC, both OpenAI routes) and completions' ``echo`` (with logprobs, and
    ``max_tokens`` 0: the prompt alone), against HF float32's log_softmax of the prompt's logits."""
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    with PdclusterClient(state["router_address"], timeout_s=300) as client:
        res = client.generate(prompt, prompt_logprobs=2, max_tokens=2, temperature=0)
        assert [lp.token_id for lp in res.prompt_logprobs] == ids and res.prompt_logprobs[0].logprob is None
        for i, lp in enumerate(res.prompt_logprobs[1:]):
            assert abs(lp.logprob - float(ref[i, ids[i + 1]])) < 1e-3 and len(lp.top) == 2 and lp.rank >= 1
        streamed = [m for m in client.stream(prompt, prompt_logprobs=0, max_tokens=3, temperature=0) if m.token_ids]
        assert len(streamed[0].prompt_logprobs) == len(ids) and not streamed[1].prompt_logprobs
    with openai.OpenAI(base_url=f"http://{state['router_http_address']}/v1", api_key="unused", max_retries=0,
                       timeout=300) as oai:
        choice = oai.completions.create(model="", prompt=prompt, max_tokens=2, temperature=0,
                                        extra_body={"prompt_logprobs": 1}).choices[0]
        entries = choice.model_extra["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(ids) and next(iter(entries[1])) == str(ids[1])
        assert abs(entries[1][str(ids[1])]["logprob"] - float(ref[0, ids[1]])) < 1e-3
        echoed = oai.completions.create(model="", prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                        temperature=0).choices[0]
        assert echoed.text == prompt and echoed.logprobs.token_logprobs[0] is None
        assert len(echoed.logprobs.tokens) == len(ids) and echoed.logprobs.text_offset[0] == 0
        assert abs(echoed.logprobs.token_logprobs[1] - float(ref[0, ids[1]])) < 1e-3
        both = oai.completions.create(model="", prompt=prompt, max_tokens=3, echo=True, logprobs=0,
                                      temperature=0, extra_body={"ignore_eos": True}).choices[0]
        assert both.text.startswith(prompt) and len(both.logprobs.tokens) == len(ids) + 3
        assert both.model_extra["prompt_logprobs"] is None  # not asked for: null, as vLLM's
        stream = oai.completions.create(model="", prompt=prompt, max_tokens=3, echo=True, stream=True, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == both.text
        chat = oai.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                           extra_body={"prompt_logprobs": 0})
        assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 3
        for kwargs, param in [(dict(stream=True, extra_body={"prompt_logprobs": 0}), "prompt_logprobs"),
                              (dict(stream=True, echo=True, logprobs=1), "echo"),
                              (dict(echo=True, extra_body={"truncate_prompt_tokens": 4}), "echo")]:
            with pytest.raises(openai.BadRequestError) as bad:
                oai.completions.create(model="", prompt=prompt, max_tokens=2, **kwargs)
            assert bad.value.body["param"] == param, bad.value.body
        with pytest.raises(openai.BadRequestError) as bad:
            oai.chat.completions.create(model="", messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                        extra_body={"echo": True})
        assert bad.value.body["param"] == "echo", bad.value.body
    assert_no_leak(state)


def test_bad_words_end_to_end(state, tokenizer, hf_model):
    """vLLM's ``bad_words`` on both workers (first token: prefill; the rest: decode) and both front doors:
    greedy output equals HF float32 greedy under the same bans (output tokens only), token for token."""
    prompt = "The capital of France is"
    words = [" Paris", "the city of"]
    seqs = RequestValidator(tokenizer, Limits(max_model_len=256, vocab_size=VOCAB))._bad_words(words)
    ids, ref, gaps = tokenizer.encode(prompt), [], []
    with torch.no_grad():
        for _ in range(8):
            logits = hf_model(torch.tensor([ids + ref])).logits[0, -1].float()
            logits[list(banned_next(seqs, ref))] = float("-inf")
            top2 = logits.topk(2).values
            gaps.append(float(top2[0] - top2[1]))
            ref.append(int(logits.argmax()))
    with PdclusterClient(state["router_address"], timeout_s=300) as client:
        plain = client.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True)
        assert "Paris" in plain.text, plain.text  # the ban changes the answer
        res = client.generate(prompt, bad_words=words, max_tokens=8, temperature=0, ignore_eos=True)
        assert_greedy_matches(res.token_ids, ref, gaps, "bad words")
        assert " Paris" not in res.text, res.text
    with openai.OpenAI(base_url=f"http://{state['router_http_address']}/v1", api_key="unused", max_retries=0,
                       timeout=300) as oai:
        answer = oai.completions.create(model="", prompt=prompt, max_tokens=8, temperature=0,
                                        extra_body={"bad_words": words, "ignore_eos": True})
        assert answer.choices[0].text == res.text
        with pytest.raises(openai.BadRequestError) as bad:  # vLLM's field is a list
            oai.completions.create(model="", prompt=prompt, max_tokens=2, extra_body={"bad_words": "Paris"})
        assert bad.value.body["param"] == "bad_words", bad.value.body
    assert_no_leak(state)
