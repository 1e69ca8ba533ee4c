"""Triton kernels for attention over the paged KV cache (CUDA; on CPU they run only under
the Triton interpreter, ``TRITON_INTERPRET=1`` set by the caller before import).

* :mod:`engine.kernels.paged_decode_attention`: split-K flash-decoding, one token per sequence.
* :mod:`engine.kernels.varlen_prefill_attention`: varlen causal FlashAttention-2 forward
  (prefill, chunked prefill over a cached prefix, mixed steps).
* :mod:`engine.kernels.triton_backend`: the ``"triton"`` attention backend dispatching between them.

Each kernel module holds the kernel, its launcher and a plain-torch reference.
"""
