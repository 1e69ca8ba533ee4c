// RMSNorm over the last dimension of float32 rows, one call per norm: what torch runs as about ten
// operators (pow, mean, add, rsqrt, mul, casts) per call, each costing microseconds of dispatch for a
// few hundred floats of work at decode (SmolLM2: 61 norms per step, ~1 ms of a batch-1 step).
//
// rms_norm(x [R, D], weight [D], eps, offset) -> [R, D]; add_rms_norm_(x, residual, ...) adds x into residual
// first (in place) and norms the sum (vLLM's fused_add_rms_norm).
//   out[r, j] = (x[r, j] * inv_r) * (offset + weight[j]),  inv_r = 1 / sqrt(mean_j(x[r, j]^2) + eps)
//   offset 0: Llama / Qwen (HF `weight * hidden`); offset 1: Gemma (HF `norm(x) * (1 + weight)`).
//   The sum of squares is accumulated in float32 over 16 (AVX-512) / 8 (AVX2) lanes, then summed in
//   double: its rounding differs from torch's reduction order by a few ulp, never more. x and weight
//   CPU float32 and contiguous; a bad argument raises RuntimeError naming it. Rows are split over
//   torch's intra-op threads (at::parallel_for) when there are enough of them.
#include "torch_ext.h"
#include "kernel_abi.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "simd.h"

namespace {

inline float sum_squares(const float* x, int64_t d) {
  int64_t j = 0;
  double total = 0.0;
#if defined(PDC_AVX512)
  __m512 acc = _mm512_setzero_ps();
  for (; j + 16 <= d; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, acc);
  for (float l : lanes) total += l;
#elif defined(PDC_AVX2)
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= d; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float l : lanes) total += l;
#endif
  for (; j < d; ++j) total += static_cast<double>(x[j]) * x[j];
  return static_cast<float>(total);
}

void norm_row(const float* x, const float* w, float* out, int64_t d, float eps, float offset) {
  const float inv = 1.0f / std::sqrt(sum_squares(x, d) / static_cast<float>(d) + eps);
  for (int64_t j = 0; j < d; ++j) out[j] = (x[j] * inv) * (offset + w[j]);
}

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.is_contiguous(), name,
              " must be a contiguous CPU float32 tensor, got ", t.scalar_type(), " on ", t.device(), " strides ",
              t.strides());
}

void check_args(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_f32(x, "x");
  check_f32(weight, "weight");
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1), "weight must be [D = ",
              x.dim() >= 1 ? x.size(-1) : 0, "] for x of shape ", x.sizes(), ", got ", weight.sizes());
  TORCH_CHECK(eps >= 0.0, "eps must be >= 0, got ", eps);
}

// Calls row(r, out_row) for every row r of x (checked: check_args), split over threads; returns out.
template <typename Row>
torch::Tensor over_rows(const torch::Tensor& x, Row row) {
  torch::Tensor out = torch::empty_like(x);
  const int64_t d = x.size(-1), rows = d == 0 ? 0 : x.numel() / d;
  if (rows == 0) return out;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) row(r, op + r * d);
  });
  return out;
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, double offset) {
  check_args(x, weight, eps);
  const int64_t d = x.size(-1);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float e = static_cast<float>(eps), o = static_cast<float>(offset);
  return over_rows(x, [&](int64_t r, float* out) { norm_row(xp + r * d, wp, out, d, e, o); });
}

// residual += x (in place), then returns rms_norm(residual): vLLM's fused_add_rms_norm, the residual add
// of a decoder block and the next norm in one call. The sum is the float32 add torch's `residual + x`
// computes (bit for bit); the norm is rms_norm's.
torch::Tensor add_rms_norm_(const torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight, double eps,
                            double offset) {
  check_args(x, weight, eps);
  check_f32(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), "residual must have x's shape ", x.sizes(), ", got ", residual.sizes());
  const int64_t d = x.size(-1);
  const float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float e = static_cast<float>(eps), o = static_cast<float>(offset);
  return over_rows(x, [&](int64_t r, float* out) {
    float* sum = rp + r * d;
    for (int64_t j = 0; j < d; ++j) sum[j] = sum[j] + xp[r * d + j];
    norm_row(sum, wp, out, d, e, o);
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("rms_norm_abi") =  // decode_step.cpp
      pdc_abi::abi_capsule(pdc_abi::kRmsNorm, &rms_norm);
  m.attr("add_rms_norm__abi") =  // decode_step.cpp
      pdc_abi::abi_capsule(pdc_abi::kAddRmsNorm, &add_rms_norm_);
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim: (x * rsqrt(mean(x^2) + eps)) * (offset + weight)",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("offset") = 0.0,
        py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x in place, then RMSNorm of residual (a new tensor)",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"), py::arg("offset") = 0.0,
        py::call_guard<py::gil_scoped_release>());
}
