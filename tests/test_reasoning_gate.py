"""Reasoning-aware structured outputs: a constraint holds for the answer after the thinking only.

The router's gate per reasoning parser (:mod:`router.reasoning_gate`), the workers' gate over the outputs
(:mod:`engine.reasoning_gate` inside :class:`engine.structured_output.GrammarState`), and real prefill
and decode schedulers against HF float32 greedy: unconstrained while thinking, under xgrammar's mask
after ``</think>``, whether the worker sampled the marker's last token or a migration replayed it.
SmolLM2 writes ``</think>`` as three tokens; ``<think>`` as one token is checked with a tokenizer that
has it (as Qwen3's and DeepSeek-R1's have)."""

from __future__ import annotations

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from cluster_utils import assert_greedy_matches, hf_constrained_greedy, hf_greedy
from engine.reasoning_gate import ReasoningGate
from engine.structured_output import grammar_compiler
from engine.token_bitmask import unpack_bitmask
from pdcluster.client import build_request
from pdcluster.v1 import common_pb2, worker_pb2
from router.limits import Limits
from router.reasoning_gate import GateTokens
from router.validation import RequestValidator
from sched_helpers import CPU, model  # noqa: F401 - fixture
from serving.convert import request_from_proto
from test_migration_resume import _run

DIGITS = "[0-9]{64}"  # never complete within N: the runs end by length
N = 16
N_FREE = 8  # HF's free greedy ends with EOS after 8 tokens
PROMPT = ("<|im_start|>user\nWhat is the capital of France? Answer with a number of digits.<|im_end|>\n"
          "<|im_start|>assistant\n<think>\n")


@pytest.fixture(scope="module")
def grammars(model_config):
    return grammar_compiler(model_config)


@pytest.fixture(scope="module")
def end_ids(tokenizer):
    return tokenizer.encode("</think>", add_special_tokens=False)


def _state(grammars, gate: ReasoningGate, regex: str = DIGITS):
    from common.structured_outputs import StructuredOutput

    return grammars.compile(StructuredOutput("regex", regex, False), gate=gate)


def _allowed(mask, vocab: int) -> set[int]:
    return set(unpack_bitmask(mask, vocab).nonzero().flatten().tolist())


def test_each_parser_reads_the_output_as_its_text_split_does(tokenizer, end_ids):
    """deepseek_r1 starts thinking, qwen3 answering, whatever the prompt says (a user's text may mention the
    tags); "</think>" is matched as written and after a space (SmolLM2 writes " </think>" otherwise)."""
    spaced = tokenizer.encode(" </think>", add_special_tokens=False)
    for parser, thinking in (("deepseek_r1", True), ("qwen3", False)):
        gate = GateTokens.of(parser, tokenizer).gate()
        assert ([list(e.ids) for e in gate.end_token_ids], gate.thinking) == ([end_ids, spaced], thinking)
        assert not gate.HasField("opener_token_id")  # SmolLM2 writes "<think>" as three tokens


def test_a_one_token_think_may_open_the_answer(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    opener, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    qwen3 = GateTokens.of("qwen3", tok)
    assert (qwen3.opener, qwen3.ends) == (opener, ((end,),))  # " </think>" is a space, then the marker
    assert qwen3.gate().opener_token_id == opener
    assert not GateTokens.of("deepseek_r1", tok).gate().HasField("opener_token_id")  # already thinking


def test_the_router_gates_constrained_requests_only(tokenizer, model_config):
    plain = RequestValidator(tokenizer, Limits(256, model_config.vocab_size))
    gated = RequestValidator(tokenizer, Limits(256, model_config.vocab_size), reasoning_parser="deepseek_r1")
    constrained = build_request("Hi </think>", structured_outputs={"regex": DIGITS}, max_tokens=4)
    assert not plain.prepare(constrained).worker_request.HasField("reasoning_gate")
    assert not gated.prepare(build_request("Hi", max_tokens=4)).worker_request.HasField("reasoning_gate")
    assert gated.prepare(constrained).worker_request.reasoning_gate.thinking


def test_the_grammar_waits_for_the_end_of_the_thinking(grammars, model_config, tokenizer, end_ids):
    vocab = model_config.vocab_size
    state = _state(grammars, ReasoningGate((tuple(end_ids),), thinking=True))
    fresh = _allowed(_state(grammars, None).bitmask([]), vocab)
    outputs = tokenizer.encode("I think </ think", add_special_tokens=False)  # no marker yet
    assert state.bitmask(outputs) is None and not state.ended(outputs)
    outputs += end_ids
    assert _allowed(state.bitmask(outputs), vocab) == fresh
    digits = tokenizer.encode("12", add_special_tokens=False)
    outputs += digits
    assert state.advance(outputs) and state.num_accepted == len(digits)
    outputs += tokenizer.encode("ab", add_special_tokens=False)
    assert state.ended(outputs) and state.rejected_at == len(outputs) - 1
    spaced = _state(grammars, ReasoningGate((tuple(end_ids), (22577, 17400, 46)), thinking=True))  # " </think>"
    assert spaced.bitmask([5, 22577, 17400]) is None and spaced.bitmask([5, 22577, 17400, 46]) is not None


def test_an_opener_first_opens_a_thinking_else_the_grammar_starts_at_once(grammars, model_config, tokenizer):
    vocab, opener, end = model_config.vocab_size, 63, (9617, 17400, 46)  # stand-ins (63: a word's sign bit)
    fresh = _allowed(_state(grammars, None).bitmask([]), vocab)
    state = _state(grammars, ReasoningGate((end,), thinking=False, opener=opener))
    assert _allowed(state.bitmask([]), vocab) == fresh | {opener}
    assert state.bitmask([opener, 5]) is None
    assert _allowed(state.bitmask([opener, 5, *end]), vocab) == fresh
    direct = _state(grammars, ReasoningGate((end,), thinking=False, opener=opener))
    digit = tokenizer.encode("1", add_special_tokens=False)
    assert direct.advance(digit) and direct.num_accepted == 1 and opener not in _allowed(direct.bitmask(digit), vocab)


def test_the_workers_read_the_gate_and_refuse_a_bad_one(grammars, model_config, tokenizer, end_ids):
    def wreq(gate, outputs=()):
        return worker_pb2.WorkerRequest(
            request_id="g", prompt_token_ids=[1, 2], sampling=common_pb2.SamplingParams(max_tokens=32),
            output_token_ids=list(outputs), structured_outputs=common_pb2.StructuredOutputs(regex=DIGITS),
            reasoning_gate=gate)

    vocab = model_config.vocab_size
    thinking = tokenizer.encode("no digits here", add_special_tokens=False) + end_ids + tokenizer.encode("7", add_special_tokens=False)
    def ends(*seqs):
        return [common_pb2.TokenSequence(ids=s) for s in seqs]

    req = request_from_proto(wreq(worker_pb2.ReasoningGate(end_token_ids=ends(end_ids), thinking=True), thinking),
                             "t", CPU, vocab, grammars)
    assert req.grammar.num_accepted == 1
    for bad, why in [(ends(), "must hold at least one sequence, none empty"), (ends(end_ids, []), "none empty"),
                     (ends(*[[1]] * 9), "at most 8 sequences of at most 16 tokens"),
                     (ends([1] * 17), "at most 8 sequences"), (ends([vocab]), "must be below the vocabulary size")]:
        with pytest.raises(ValueError, match=why):
            request_from_proto(wreq(worker_pb2.ReasoningGate(end_token_ids=bad, thinking=True)), "t", CPU, vocab,
                               grammars)


def _wreq(rid, prompt, outputs=(), bias=None, gate=None, max_tokens=N):
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0, ignore_eos=True,
                                         repetition_penalty=1.0, logit_bias=bias or {})
    return worker_pb2.WorkerRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                                    output_token_ids=list(outputs), reasoning_gate=gate,
                                    structured_outputs=common_pb2.StructuredOutputs(regex=DIGITS))


def test_workers_think_freely_then_answer_in_the_grammar_as_hf(model, model_config, tokenizer, hf_model, grammars,
                                                               end_ids):
    """Through a real prefill and decode worker: while thinking, greedy equals HF's unconstrained greedy;
    where the prefill worker samples the marker's last token (a logit bias makes it), the decode worker
    sees the marker and the rest equals HF greedy under xgrammar's mask after it."""
    prompt = tokenizer.encode(PROMPT)
    gate = worker_pb2.ReasoningGate(end_token_ids=[common_pb2.TokenSequence(ids=end_ids)], thinking=True)
    ref, gaps = hf_greedy(hf_model, prompt, N_FREE)
    assert tokenizer.decode(ref).strip().startswith("The answer")  # free text, not in the grammar
    assert not any(ref[i:i + len(end_ids)] == end_ids for i in range(len(ref)))  # and no marker
    free = _run(model, model_config, _wreq("free", prompt, gate=gate, max_tokens=N_FREE), grammars=grammars)
    assert_greedy_matches(free, ref, gaps, "thinking")
    thought = tokenizer.encode("\nIt is Paris.\n", add_special_tokens=False) + end_ids[:-1]
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model_config.vocab_size,
                                                                      stop_token_ids=list(model_config.eos_token_ids)))
    answer, gaps = hf_constrained_greedy(hf_model, tokenizer, model_config, prompt + thought + end_ids[-1:],
                                         compiled.compile_regex(DIGITS), N - len(thought) - 1)
    ours = _run(model, model_config, _wreq("ends", prompt, thought, {end_ids[-1]: 100.0}, gate), grammars=grammars)
    assert ours[0] == end_ids[-1]
    assert_greedy_matches(ours[1:], answer, gaps, "answer")
    assert tokenizer.decode(ours[1:]).isdigit()

