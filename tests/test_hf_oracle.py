"""The suite's HF float32 oracle, batched: :func:`cluster_utils.hf_greedy_batch` (prompts of
similar length left-padded into one ``generate`` call) gives :func:`cluster_utils.hf_greedy`'s
tokens for each prompt, stops a row at its EOS as the unbatched call does, and its top-2 gaps
differ from the unbatched ones by float rounding only."""

from __future__ import annotations

from cluster_utils import hf_greedy, hf_greedy_batch, render_chat


def test_batched_references_equal_one_at_a_time(hf_model, tokenizer):
    base = tokenizer.encode("Shall I compare thee to a summer's day? Thou art more lovely and more temperate: "
                            "Rough winds do shake the darling buds of May")
    prompts = [base[:1], render_chat(tokenizer, [{"role": "user", "content": "What is 2+2? Answer with a number only."}]),
               base[:9], base]
    singles = [hf_greedy(hf_model, p, 12) for p in prompts]
    assert any(len(tokens) < 12 for tokens, _ in singles), "no prompt ended at EOS: the cut is not exercised"
    batched = hf_greedy_batch(hf_model, prompts, 12, group=3)  # two calls: groups are cut by length
    for p, (tokens, gaps), (want, want_gaps) in zip(prompts, batched, singles):
        assert tokens == want, (len(p), tokens, want)
        assert len(gaps) == len(want_gaps) and max(abs(a - b) for a, b in zip(gaps, want_gaps)) < 1e-3
