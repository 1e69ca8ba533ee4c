"""Tests for common.detokenizer with the real SmolLM2 tokenizer."""

from __future__ import annotations

import random

import pytest

from common.detokenizer import IncrementalDetokenizer, StopStringMatcher
from common.tokenizer import load_tokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Emoji: 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 done",
    "中文测试：你好，世界！日本語のテキスト、한국어 텍스트.",
    "Accents café naïve Ünïcödé, math ∑∫√∞ ≠ ≤, arrows → ⇒",
    "<|im_start|>assistant\nSure 🙂 here<|im_end|> after end<|endoftext|>",
    "  leading spaces and\n\nnewlines\ttabs  ",
    "x",
]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    """The router's torch-free tokenizer of the bundled model."""
    return load_tokenizer(model_dir)


def _stream(tokenizer, prompt_ids, output_ids, chunk_sizes, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas, i, sizes = [], 0, iter(chunk_sizes)
    while i < len(output_ids):
        n = next(sizes, 1)
        deltas.append(detok.add(output_ids[i : i + n]))
        i += n
    deltas.append(detok.finish())
    assert detok.text == "".join(deltas)
    assert detok.output_token_ids == output_ids
    return deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_stream_matches_full_decode(tokenizer, text, skip):
    prompt_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say something."}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "input_ids"):
        prompt_ids = prompt_ids["input_ids"]
    output_ids = tokenizer.encode(text)
    full = tokenizer.decode(output_ids, skip_special_tokens=skip)
    rng = random.Random(len(text))
    for chunks in ([], [rng.randint(1, 4) for _ in output_ids]):
        deltas = _stream(tokenizer, prompt_ids, output_ids, chunks, skip_special_tokens=skip)
        assert "".join(deltas) == full
        # Complete characters only: no replacement char leaks mid-stream.
        assert not any("\ufffd" in d for d in deltas)


def test_multibyte_char_held_until_complete(tokenizer):
    ids = tokenizer.encode("😀")
    assert len(ids) > 1  # byte-level BPE splits the emoji across tokens
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi"))
    assert [detok.add([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "😀"
    assert detok.finish() == ""


def test_truncated_multibyte_flushed_by_finish(tokenizer):
    ids = tokenizer.encode("ok 世")
    detok = IncrementalDetokenizer(tokenizer, [])
    out = "".join(detok.add([i]) for i in ids[:-1])
    out += detok.finish()
    assert out == tokenizer.decode(ids[:-1], skip_special_tokens=True)
    assert out.endswith("\ufffd")


def test_prompt_ending_mid_character_is_not_context(tokenizer):
    emoji = tokenizer.encode("🎉")
    prompt, output = tokenizer.encode("Party ") + emoji[:1], emoji[1:] + tokenizer.encode(" time")
    deltas = _stream(tokenizer, prompt, output, [])
    assert "".join(deltas) == tokenizer.decode(output, skip_special_tokens=True)


def test_special_tokens_and_out_of_vocab_ids(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("Done.") + [eos, len(tokenizer) + 10]
    detok = IncrementalDetokenizer(tokenizer, [1])
    deltas = [detok.add([i]) for i in ids] + [detok.finish()]
    assert "".join(deltas) == "Done."
    assert deltas[-3:] == ["", "", ""]


def _reference_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """Non-streamed truncation: cut before the stop occurrence that ends first."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text.endswith(s, 0, end)]
        if hits:
            return text[: end - max(map(len, hits))], True
    return text, False


def _feed_all(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    matcher = StopStringMatcher(stops)
    out = []
    for d in deltas:
        emit, stopped = matcher.feed(d)
        out.append(emit)
        if stopped:
            assert matcher.stopped
            assert matcher.feed("more") == ("", True)
            assert matcher.flush() == ""
            return "".join(out), True
    out.append(matcher.flush())
    return "".join(out), False


@pytest.mark.parametrize(
    ("stops", "deltas", "expected"),
    [
        (["STOP"], ["Hello S", "T", "O", "P and more"], ("Hello ", True)),
        (["STOP"], ["STOP right away"], ("", True)),
        (["STOP"], ["ST", "OP"], ("", True)),
        (["STOP"], ["no stop", " here S", "T"], ("no stop here ST", False)),
        (["abc"], ["a", "a", "b", "a", "b", "c", "d"], ("aab", True)),
        (["aab"], ["a", "a", "a", "b"], ("a", True)),
        (["\n\n", "END", "###"], ["line1\n", "line2 E", "N", "D\n", "\n"], ("line1\nline2 ", True)),
        (["###", "END"], ["a #", "## b END"], ("a ", True)),
        (["xyz", "y"], ["x", "y", "z"], ("x", True)),
        ([], ["plain ", "text"], ("plain text", False)),
    ],
)
def test_stop_string_cases(stops, deltas, expected):
    assert _feed_all(stops, deltas) == expected
    assert _feed_all(stops, ["".join(deltas)]) == expected
    assert _reference_stop("".join(deltas), stops) == expected


def test_stop_matcher_holds_only_possible_prefixes():
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("value is 4") == ("value is 4", False)
    assert matcher.feed(" </ans") == (" ", False)
    assert matcher.feed("wer-ish") == ("</answer-ish", False)
    assert matcher.feed("</answer>tail") == ("", True)


def test_stop_matcher_random_splits_match_reference():
    rng = random.Random(0)
    stops = ["ab", "bca", "cc", "abcab"]
    for _ in range(300):
        text = "".join(rng.choice("abcd") for _ in range(rng.randint(0, 20)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        deltas = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        emitted, stopped = _feed_all(stops, deltas)
        assert (emitted, stopped) == _reference_stop(text, stops)
        assert not any(s in emitted for s in stops)


def test_stop_matcher_rejects_empty_stop():
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


def test_stop_matcher_can_keep_the_stop_string():
    """vLLM's ``include_stop_str_in_output``: cut after the first stop instead of before it."""
    matcher = StopStringMatcher(["STOP", "TO"], include=True)
    assert matcher.feed("Hello S") == ("Hello ", False)
    assert matcher.feed("TOP and more") == ("STO", True)  # "TO" ends first
    matcher = StopStringMatcher(["\n\n"], include=True)
    assert matcher.feed("a\n") == ("a", False)
    assert matcher.feed("\nb") == ("\n\n", True)
