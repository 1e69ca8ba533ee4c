"""C++ CPU kernels (``csrc/*.cpp``), built as torch extensions by :mod:`engine.kernels.cpu.build`.

Each kernel has a plain-torch fallback that its caller uses when the extension is not built
(no compiler on the machine): the extension is a speed-up, never a requirement.

* ``gemv`` (``load("gemv")``): ``linear_f32(x [M, K] f32, weight [N, K] f32 contiguous,
  bias [N] f32 | None) -> [M, N] f32``, the batch-1..4 decode matmul of the ``"gemv"`` linear
  backend (:class:`engine.model.linear.GemvLinear`).
* ``w8a8_gemm`` (``load("w8a8_gemm")``): int8 weights times per-call int8 activations, integer dot
  products (AVX-512 VNNI): ``linear_w8a8(x [M, K] f32, wpack, spack, excess, n, bias | None) -> [M, n] f32``
  over :func:`engine.kernels.cpu.quant_ops.pack_int8`'s panel layout.
* ``w4a8_gemm`` (``load("w4a8_gemm")``): GGUF Q4_1 weights times per-call int8 activations, integer dot
  products: ``linear_w4a8(x [M, K] f32, wpack, dm, n, bias | None) -> [M, n] f32`` over
  :func:`engine.kernels.cpu.quant_ops.pack_q4_1`'s panel layout. Both raise ``RuntimeError`` naming a
  bad argument.

* ``rope_cache`` (:mod:`engine.kernels.cpu.rope_cache`): one layer's rotate-half RoPE of q and k
  and its K/V written into the paged cache at the slot mapping, in one call, bit-identical to the
  decoder's torch expression (:meth:`engine.model.rope.RopeStep.rotate_and_store`).
* ``rms_norm`` (:mod:`engine.kernels.cpu.rms_norm`): RMSNorm of float32 rows in one call (Llama's and
  Gemma's forms), the decoder's :class:`~engine.model.decoder.RMSNorm` on CPU float32.
* ``block_copy`` (``load("block_copy")``): KV block-row copies that take the bytes' CRC32C on the
  way, one pass over memory: ``gather_framed`` (rows into a new ``bytes`` after a prefix, the CRC
  written into it) and ``gather_crc`` (into a tensor, returning the CRC); used by :mod:`kvtransfer.onepass`.

* ``activation`` (:mod:`engine.kernels.cpu.activation`): ``silu_and_mul``, a gated MLP's activation,
  bit-identical to ``F.silu(gate) * up``.
* ``argmax`` (:mod:`engine.kernels.cpu.argmax`): ``argmax_rows``, ``torch.argmax(dim=-1)`` of float32 logits
  rows, the sampler's greedy pick.
* ``decode_step`` (:mod:`engine.kernels.cpu.decode_step`): a decode step's decoder layers in one call, the
  layer loop of :class:`engine.model.decode_plan.DecodePlan`; it calls the other kernels through the entry
  points they export as capsules (``csrc/kernel_abi.h``).

``bench/gemv.py`` measures the matmuls against ``F.linear`` and oneDNN at decode row counts.
"""
