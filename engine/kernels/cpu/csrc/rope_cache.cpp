// One layer's rotary embedding of a step's queries and keys, and its keys and values written into
// the paged KV cache, in one call: what the decoder otherwise does with about twenty torch
// operators per layer (rotate-half RoPE on q and k, the cache's layer slices, two index_copy_).
// At decode each of those operators costs microseconds of dispatch for a few hundred floats of
// work: over SmolLM2's 30 layers about 1 ms of a batch-1 decode step on this project's machine.
//
// The rotation is rotate-half RoPE as HF transformers computes it (`q * cos + rotate_half(q) *
// sin`, rotate_half(x) = cat(-x[half:], x[:half])), element by element with the same three
// roundings (two products, one sum) and no fused multiply-add (contraction is off for this
// file's functions), so the result is bit-identical to the torch expression.
//
// rope_store(q [T, H, D], k [T, KH, D], v [T, KH, D], cos [T, D], sin [T, D],
//            kv_cache [L, 2, NB, BS, KH, D], layer, slot_mapping [T] int64) -> None
//   q is rotated in place; rotated k goes to kv_cache[layer, 0] and v to kv_cache[layer, 1] at
//   flat slot slot_mapping[t] (block * BS + offset) of token t; k and v are not modified. Every
//   tensor float32 (slot_mapping int64), CPU, contiguous; a bad argument raises RuntimeError
//   naming it. Tokens are split over torch's intra-op threads (at::parallel_for).
#include "torch_ext.h"
#include "kernel_abi.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kMaxHeadDim = 1024;

// out[j] = x[j] * c[j] + rot(x)[j] * s[j] for one head of d floats (d even; out may alias x)
__attribute__((optimize("fp-contract=off"))) inline void rotate(const float* x, const float* c, const float* s,
                                                                 float* out, int64_t d) {
  float tmp[kMaxHeadDim];
  const int64_t h = d / 2;
  for (int64_t j = 0; j < h; ++j) {
    const float a = x[j] * c[j];
    const float b = (-x[j + h]) * s[j];
    tmp[j] = a + b;
  }
  for (int64_t j = h; j < d; ++j) {
    const float a = x[j] * c[j];
    const float b = x[j - h] * s[j];
    tmp[j] = a + b;
  }
  std::memcpy(out, tmp, d * sizeof(float));
}

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.is_contiguous(), name,
              " must be a contiguous CPU float32 tensor, got ", t.scalar_type(), " on ", t.device(), " strides ",
              t.strides());
}

void check_args(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& cos,
                const torch::Tensor& sin, const torch::Tensor& kv_cache, int64_t layer,
                const torch::Tensor& slots) {
  check_f32(q, "q");
  check_f32(k, "k");
  check_f32(v, "v");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  check_f32(kv_cache, "kv_cache");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes() && q.size(0) == k.size(0) &&
                  q.size(2) == k.size(2),
              "q must be [T, H, D] and k, v [T, KH, D], got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  const int64_t t = q.size(0), d = q.size(2);
  TORCH_CHECK(d % 2 == 0 && d <= kMaxHeadDim, "head_dim must be even and <= ", kMaxHeadDim, ", got ", d);
  TORCH_CHECK(cos.numel() == t * d && sin.numel() == t * d, "cos and sin must hold [T, D] = [", t, ", ", d,
              "] floats, got ", cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(1) == 2 && kv_cache.size(4) == k.size(1) && kv_cache.size(5) == d,
              "kv_cache must be [L, 2, NB, BS, KH=", k.size(1), ", D=", d, "], got ", kv_cache.sizes());
  TORCH_CHECK(layer >= 0 && layer < kv_cache.size(0), "layer ", layer, " outside [0, ", kv_cache.size(0), ")");
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == torch::kLong && slots.dim() == 1 &&
                  slots.is_contiguous() && slots.numel() == t,
              "slot_mapping must be a contiguous CPU int64 [T = ", t, "] tensor, got ", slots.scalar_type(), " ",
              slots.sizes());
  const int64_t num_slots = kv_cache.size(2) * kv_cache.size(3);
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(s[i] >= 0 && s[i] < num_slots, "slot_mapping[", i, "] = ", s[i], " outside [0, ", num_slots, ")");
}

void rope_store(torch::Tensor q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& cos,
                const torch::Tensor& sin, torch::Tensor kv_cache, int64_t layer, const torch::Tensor& slots) {
  check_args(q, k, v, cos, sin, kv_cache, layer, slots);
  const int64_t t = q.size(0), h = q.size(1), kh = k.size(1), d = q.size(2);
  const int64_t row = kh * d;  // floats of one token's K (or V) in the cache
  float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  float* k_cache = kv_cache.data_ptr<float>() + layer * kv_cache.stride(0);
  float* v_cache = k_cache + kv_cache.stride(1);
  const int64_t grain = std::max<int64_t>(1, 4096 / ((h + 2 * kh) * d));
  at::parallel_for(0, t, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* c = cp + i * d;
      const float* s = sp + i * d;
      for (int64_t j = 0; j < h; ++j) rotate(qp + (i * h + j) * d, c, s, qp + (i * h + j) * d, d);
      float* kdst = k_cache + slot[i] * row;
      for (int64_t j = 0; j < kh; ++j) rotate(kp + (i * kh + j) * d, c, s, kdst + j * d, d);
      std::memcpy(v_cache + slot[i] * row, vp + i * row, row * sizeof(float));
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("rope_store_abi") =  // decode_step.cpp
      pdc_abi::abi_capsule(pdc_abi::kRopeStore, &rope_store);
  m.def("rope_store", &rope_store, "rotate q in place; rotated k and v into the paged KV cache at slot_mapping",
        py::call_guard<py::gil_scoped_release>());
}
