// fp32 skinny matmul (GEMV for a few rows): y[M, N] = x[M, K] @ W[N, K]^T + b[N].
//
// Built for batch-1..8 decode, where every weight is read once per step and the work is bound by
// memory bandwidth: W stays in its plain row-major [N, K] layout (measured here: one sequential
// stream per thread keeps the hardware prefetchers busy and reaches the machine's read bandwidth,
// so no packed layout is needed). Each thread takes a contiguous range of output features
// (at::parallel_for over torch's intra-op threads) and walks its weight rows one at a time (one
// sequential stream: interleaving 4 rows measured up to 4x slower here); each row is dotted with
// up to 4 input rows at a time in registers (AVX-512 where the build machine has it, else
// AVX2+FMA, else scalar), and further input rows reuse the row from L1. The usual register-blocked dot-product GEMV (as in llama.cpp's
// ggml_vec_dot_f32 or BLAS sgemv "T" kernels); summation order differs from oneDNN/MKL, so results
// agree with F.linear to float rounding (~1e-6 relative), not bit for bit.
#include "torch_ext.h"

#include <algorithm>
#include <cstdint>

#include "simd.h"

namespace {

constexpr int64_t NT = 1;  // weight rows per register tile (1 measured fastest: one sequential stream)

// out[m * ldo + j] = dot(x[m], w[j]) for m < MT, j < NT (or j < 1 when ONE).
template <int MT, int NR>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo) {
  int64_t k = 0;
  float acc_s[MT][NR] = {};
#ifdef PDC_AVX512
  {
    __m512 acc[MT][NR];
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16) {
      __m512 wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = _mm512_loadu_ps(w + j * K + k);
      for (int m = 0; m < MT; ++m) {
        const __m512 xv = _mm512_loadu_ps(x + m * ldx + k);
        for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
      }
    }
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < NR; ++j) acc_s[m][j] = _mm512_reduce_add_ps(acc[m][j]);
  }
#endif
#ifdef PDC_AVX2
  __m256 acc[MT][NR];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NR; ++j) acc[m][j] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_ps(w + j * K + k);
    for (int m = 0; m < MT; ++m) {
      __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
      for (int j = 0; j < NR; ++j) acc[m][j] = _mm256_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NR; ++j) acc_s[m][j] += hsum(acc[m][j]);
#endif
  for (; k < K; ++k)
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < NR; ++j) acc_s[m][j] += x[m * ldx + k] * w[j * K + k];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NR; ++j) out[m * ldo + j] = acc_s[m][j];
}

template <int NR>
inline void rows_tile(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile<4, NR>(x + m * K, K, w, K, y + m * N, N);
  if (m + 2 <= M) { tile<2, NR>(x + m * K, K, w, K, y + m * N, N); m += 2; }
  if (m < M) tile<1, NR>(x + m * K, K, w, K, y + m * N, N);
}

void check_inputs(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2,
              "linear_f32: x must be a 2-D CPU float32 tensor [M, K], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == torch::kFloat32 && weight.dim() == 2,
              "linear_f32: weight must be a 2-D CPU float32 tensor [N, K], got ", weight.scalar_type(), " ",
              weight.sizes());
  TORCH_CHECK(weight.is_contiguous(), "linear_f32: weight must be contiguous (row-major [N, K])");
  TORCH_CHECK(x.size(1) == weight.size(1), "linear_f32: x has K=", x.size(1), " but weight has K=",
              weight.size(1));
  if (bias.has_value()) {
    const auto& b = *bias;
    TORCH_CHECK(b.device().is_cpu() && b.scalar_type() == torch::kFloat32 && b.dim() == 1 &&
                    b.size(0) == weight.size(0),
                "linear_f32: bias must be a CPU float32 tensor [N=", weight.size(0), "], got ", b.scalar_type(),
                " ", b.sizes());
  }
}

}  // namespace

// y = x @ weight.T + bias. x float32 [M, K] (made contiguous); weight float32 [N, K] contiguous;
// bias float32 [N] or None. Returns float32 [M, N].
torch::Tensor linear_f32(const torch::Tensor& x_in, const torch::Tensor& weight,
                         const c10::optional<torch::Tensor>& bias) {
  check_inputs(x_in, weight, bias);
  const torch::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  torch::Tensor y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  torch::Tensor b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + NT - 1) / NT;
  // grain: >= ~64 KiB of weights per task, so small matrices do not pay for a thread fork
  const int64_t grain = std::max<int64_t>(1, (16384 / std::max<int64_t>(K, 1)) / NT);
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t * NT;
      if (n + NT <= N) {
        rows_tile<NT>(xp, M, K, wp + n * K, yp + n, N);
      } else {
        for (int64_t r = n; r < N; ++r) rows_tile<1>(xp, M, K, wp + r * K, yp + r, N);
      }
      if (bp != nullptr)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t r = n; r < std::min(n + NT, N); ++r) yp[m * N + r] += bp[r];
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fp32 GEMV / skinny matmul (AVX2+FMA, row-major weights, at::parallel_for over output features)";
  m.def("linear_f32", &linear_f32, "y = x @ weight.T + bias (float32, x [M, K], weight [N, K] contiguous)",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("has_avx2", []() {
#ifdef PDC_AVX2
    return true;
#else
    return false;
#endif
  }, "whether the kernel was compiled with AVX2+FMA (else a scalar loop)");
}
