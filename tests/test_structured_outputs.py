"""Structured outputs, piece by piece: the router's checks (:mod:`common.structured_outputs`), the
workers' compile and replay (:mod:`engine.structured_output`, :func:`serving.convert.request_from_proto`),
the sampler's mask (:mod:`engine.token_bitmask`, against xgrammar's own) and the OpenAI mapping.
End to end on a real cluster, token-exact against HF with xgrammar's mask: ``tests/test_e2e_sampling.py``."""

from __future__ import annotations

import json
import time

import pytest
import torch
import xgrammar as xgr

from common.structured_outputs import MAX_CHOICES, MAX_SCHEMA_DEPTH, MAX_STRUCTURED_BYTES, choice_grammar
from engine.request import Request, RequestParams
from engine.sampling import Sampler, SamplingOptions
from engine.stop_check import check_finish
from engine.structured_output import grammar_compiler
from engine.token_bitmask import apply_token_bitmasks, unpack_bitmask
from pdcluster.client import build_request
from router.limits import Limits
from router.openai.chat import chat_requests
from router.openai.protocol import ChatCompletionRequest
from router.openai.requests import OpenAIRequestError
from router.validation import InvalidRequest, RequestValidator
from serving.convert import request_from_proto

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def grammars(model_config):
    return grammar_compiler(model_config)


@pytest.fixture(scope="module")
def validator(tokenizer, model_config):
    return RequestValidator(tokenizer, Limits(max_model_len=256, vocab_size=model_config.vocab_size))


def _worker(validator, grammars, vocab, spec, outputs=()):
    prepared = validator.prepare(build_request("hi", structured_outputs=spec, max_tokens=32))
    prepared.worker_request.output_token_ids[:] = list(outputs)
    return request_from_proto(prepared.worker_request, "t", CPU, vocab, grammars)


@pytest.mark.parametrize("vocab", [100, 49152])
def test_unpacked_bitmask_masks_as_xgrammar_does(vocab):
    gen = torch.Generator().manual_seed(vocab)
    words = torch.randint(-(1 << 31), (1 << 31) - 1, (2, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    logits = torch.randn(2, vocab, generator=gen)
    ours = apply_token_bitmasks(logits, logits, [words[0], words[1]])
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, words)
    assert torch.equal(ours, theirs) and ours is not logits
    assert unpack_bitmask(words[0], vocab).sum() == torch.isfinite(theirs[0]).sum()


def test_the_mask_is_a_hard_constraint_and_other_rows_are_untouched():
    """Greedy takes the best allowed id; ``allowed_token_ids`` disjoint from the grammar's tokens would
    leave nothing: the grammar alone then decides; an unconstrained row keeps its argmax."""
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    words = torch.zeros(2, dtype=torch.int32)
    words[0] = (1 << 5) | (1 << 9)  # ids 5 and 9
    opts = [SamplingOptions(temperature=0.0), SamplingOptions(temperature=0.0, allowed_token_ids=(1, 2)),
            SamplingOptions(temperature=0.0)]
    out = Sampler().sample(logits, opts, [None] * 3, bitmasks=[words, words, None])
    best = 5 if logits[0, 5] > logits[0, 9] else 9
    second = 5 if logits[1, 5] > logits[1, 9] else 9
    assert out.token_ids.tolist() == [best, second, int(logits[2].argmax())]


def test_min_tokens_cannot_block_a_complete_grammar(grammars, validator, model_config):
    """A complete choice allows only EOS; ``min_tokens`` would ban it: the grammar wins, the request ends."""
    req = _worker(validator, grammars, model_config.vocab_size, {"choice": ["yes"]})
    req.output_token_ids.extend(validator.tokenizer.encode("yes", add_special_tokens=False))
    mask = req.grammar.bitmask(req.output_token_ids)
    eos = model_config.eos_token_ids
    assert unpack_bitmask(mask, model_config.vocab_size).nonzero().flatten().tolist() == list(eos)
    logits = torch.randn(1, model_config.vocab_size)
    out = Sampler().sample(logits, [SamplingOptions(temperature=0.0, min_tokens=8)], [None],
                           histories=[([1], req.output_token_ids)], stop_ids=[eos], bitmasks=[mask])
    req.output_token_ids.append(int(out.token_ids[0]))
    assert req.output_token_ids[-1] in eos and check_finish(req, eos, 256) == "stop"


def test_choices_with_any_character_are_matched_exactly(grammars, validator, model_config):
    choices = ['say "hi"', "back\\slash", "two\nlines", "tab\there", "ünï 日本 ✓", "a|b ::= c", ""]
    assert choice_grammar(["x"]) == 'root ::= "x"'
    for text in choices:
        req = _worker(validator, grammars, model_config.vocab_size, {"choice": choices})
        req.output_token_ids.extend(validator.tokenizer.encode(text, add_special_tokens=False))
        assert req.grammar.advance(req.output_token_ids), text
        req.output_token_ids.append(model_config.eos_token_ids[0])
        assert req.grammar.ended(req.output_token_ids) and req.grammar.rejected is None


def test_a_migrated_request_replays_its_outputs_and_a_stray_one_is_refused(grammars, validator, model_config):
    tok = validator.tokenizer
    start = tok.encode('{"a": 1', add_special_tokens=False)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    req = _worker(validator, grammars, model_config.vocab_size, {"json": schema}, outputs=start)
    assert req.grammar.num_accepted == len(start)
    allowed = unpack_bitmask(req.grammar.bitmask(req.output_token_ids), model_config.vocab_size)
    assert allowed[tok.convert_tokens_to_ids("}")] and not allowed[tok.convert_tokens_to_ids("a")]
    with pytest.raises(ValueError, match=r"output_token_ids\[0\] = \d+ does not follow structured_outputs"):
        _worker(validator, grammars, model_config.vocab_size, {"json": schema},
                outputs=tok.encode("hello", add_special_tokens=False))
    broken = Request("r", [1], RequestParams(max_tokens=8, sampling=SamplingOptions()), output_token_ids=[])
    broken.grammar = req.grammar
    broken.output_token_ids.extend(start + tok.encode("x", add_special_tokens=False))
    assert check_finish(broken, (), 256) == "stop" and req.grammar.rejected is not None


BAD = [
    ({}, "structured_outputs must give exactly one of json, regex, choice, grammar, json_object (a non-empty "
         "value), got none"),
    ({"regex": "a", "choice": ["b"]}, "got regex, choice"),
    ({"regex": "a", "disable_any_whitespace": True}, "disable_any_whitespace applies to json and json_object only"),
    ({"choice": ["x"] * (MAX_CHOICES + 1)}, f"structured_outputs.choice has {MAX_CHOICES + 1} strings; at most"),
    ({"grammar": "x" * (MAX_STRUCTURED_BYTES + 1)}, f"structured_outputs.grammar is {MAX_STRUCTURED_BYTES + 1} bytes"),
    ({"json": "{"}, "structured_outputs.json is not JSON"),
    ({"json": "[1]"}, "structured_outputs.json must be a JSON schema (an object or a boolean), got list"),
    ({"json": "[" * 5000 + "]" * 5000}, f"structured_outputs.json nests deeper than {MAX_SCHEMA_DEPTH} levels"),
    ({"json": '{"items": ' * (MAX_SCHEMA_DEPTH + 1) + "{}" + "}" * (MAX_SCHEMA_DEPTH + 1)},
     f"structured_outputs.json nests deeper than {MAX_SCHEMA_DEPTH} levels"),
]


@pytest.mark.parametrize("spec,message", BAD)
def test_the_router_refuses_malformed_constraints_naming_the_field(validator, spec, message):
    with pytest.raises(InvalidRequest, match="^structured_outputs") as exc:
        validator.prepare(build_request("hi", structured_outputs=spec))
    assert message in str(exc.value)


def test_the_workers_refuse_what_does_not_compile(validator, grammars, model_config):
    for spec, message in [({"regex": "("}, "structured_outputs.regex does not compile: Regex parsing error"),
                          ({"json": {"type": "bogus"}}, 'structured_outputs.json does not compile: Unsupported type'),
                          ({"grammar": "start ::= \"x\""}, "structured_outputs.grammar does not compile")]:
        with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")):
            _worker(validator, grammars, model_config.vocab_size, spec)
    with pytest.raises(ValueError, match="this worker does not serve structured outputs"):
        _worker(validator, None, model_config.vocab_size, {"regex": "a"})


def test_client_dict_types_are_checked():
    with pytest.raises(TypeError, match="structured_outputs.choice must be a list of strings"):
        build_request("hi", structured_outputs={"choice": "yes"})
    with pytest.raises(TypeError, match="structured_outputs.whitespace_pattern is not served"):
        build_request("hi", structured_outputs={"json": {}, "whitespace_pattern": " "})
    req = build_request("hi", structured_outputs={"json": {"type": "string"}, "disable_any_whitespace": True})
    assert json.loads(req.structured_outputs.json) == {"type": "string"} and req.structured_outputs.disable_any_whitespace


def _chat(**extra) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **extra})


def test_openai_response_format_and_structured_outputs_map_to_one_constraint():
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    _, [sub] = chat_requests(_chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))
    assert json.loads(sub.request.structured_outputs.json) == schema
    _, [sub] = chat_requests(_chat(response_format={"type": "json_object"}))
    assert sub.request.structured_outputs.json_object
    _, [sub] = chat_requests(_chat(response_format={"type": "text"}))
    assert not sub.request.HasField("structured_outputs")
    _, [sub] = chat_requests(_chat(structured_outputs={"choice": ["a", "b"]}))
    assert list(sub.request.structured_outputs.choice) == ["a", "b"]
    for extra, param in [({"response_format": {"type": "json_schema"}}, "response_format"),
                         ({"response_format": {"type": "yaml"}}, "response_format"),
                         ({"structured_outputs": {"regex": 5}}, "structured_outputs"),
                         ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
                          "response_format"),
                         ({"guided_json": {}}, "guided_json"),
                         ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend")]:
        with pytest.raises(OpenAIRequestError) as exc:
            chat_requests(_chat(**extra))
        assert exc.value.param == param, (extra, exc.value.message)


def test_a_constraint_too_slow_to_compile_is_refused_and_holds_off_others(model_config):
    """Past the compile timeout a constraint is refused as too complex (at once when asked again);
    while it still compiles (xgrammar cannot stop it), another new constraint gets GrammarBusy."""
    from common.structured_outputs import StructuredOutput
    from engine.structured_output import GrammarBusy, GrammarCompiler

    grammars = GrammarCompiler(model_config.path, model_config.vocab_size, model_config.eos_token_ids,
                               timeout_s=0.05)
    grammars.compile(StructuredOutput("regex", "a"))  # the compiler itself is built outside the budget
    slow = StructuredOutput("json", json.dumps({"type": "string", "pattern": "^[a-z]{4000}$"}))  # ~0.6 s here
    with pytest.raises(ValueError, match=r"^structured_outputs.json is too complex: it did not compile within 0.05 s"):
        grammars.compile(slow)
    with pytest.raises(GrammarBusy, match="still compiling another constraint"):
        grammars.compile(StructuredOutput("regex", "b"))
    with pytest.raises(ValueError, match="too complex"):
        grammars.compile(slow)
    deadline = time.monotonic() + 60
    while True:  # the slow compile ends and frees the slot
        try:
            grammars.compile(StructuredOutput("regex", "c"))
            break
        except GrammarBusy:
            assert time.monotonic() < deadline
