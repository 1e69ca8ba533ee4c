"""Torch-free definitions every process shares: sampling-parameter declarations, the model's config.json, tokenizer-side text handling (incremental detokenizer, stop strings), prefix-block hashes."""
