// fp32 matmul over a panel-packed weight: y[M, N] = x[M, K] @ W[N, K]^T + b[N], for any M (decode's
// 1-64 rows and prefill's thousands) from one weight layout.
//
// Layout: W's output features in panels of P = 32: panel p holds W[32p : 32p + 32, :] transposed,
// [K][32] contiguous (the last panel zero-padded), so the whole weight is [ceil(N / 32), K, 32]
// float32 (engine/kernels/cpu/panel_gemm.py packs it). This is the outer-product GEMM of BLIS /
// oneDNN's AVX-512 kernels (Van Zee and van de Geijn, "BLIS: A Framework for Rapidly Instantiating
// BLAS Functionality", 2015): per k, the panel's 32 weights are two vector loads and each input
// row's x[m, k] one broadcast, FMA'd into MT x 32 accumulators held in registers (MT = 8 with
// AVX-512's 32 registers; with AVX2's 16, 2 rows x 32 for up to 5 rows, and from 6 rows BLIS's
// 6 x 16 Haswell tile over each half of the panel); no horizontal sums.
//  * One row (batch-1 decode): each thread streams its panels front to back, one sequential read of
//    its share of the weight: the rate is the memory's, as the row-major GEMV's.
//  * More rows: a panel (K x 128 bytes: 72 KiB for K = 576) is read from memory once for the first
//    tile of rows and from L2 for the others; past 128 rows (prefill) the rows go in blocks of 128,
//    each kept in L2 while the thread's panels pass over it.
// Panels are split over torch's intra-op threads (at::parallel_for). Each output is one k-ordered
// FMA chain whatever the tile, so a row's outputs are bit-identical whatever the row count (chunked,
// batched and whole-prompt prefill write the same KV); they agree with F.linear / oneDNN to float
// rounding (~1e-6 relative), not bit for bit.
#include "torch_ext.h"
#include "kernel_abi.h"

#include <algorithm>
#include <cstdint>

#include "simd.h"

// Fully unroll the loops over a tile's rows and vectors, so that its accumulators stay in registers
// (without it GCC stores each one to the stack every k: one store per FMA, half the FMA rate).
#define PDC_UNROLL _Pragma("GCC unroll 8")

namespace {

constexpr int64_t P = 32;    // output features per panel
constexpr int64_t MB = 128;  // input rows per block (prefill): 128 x K floats stay in L2

#if defined(PDC_AVX512)
constexpr int MT_MAX = 8;
// y[m, 0:cols] = x[m, :] . panel for m < MT (cols <= 32 valid outputs)
template <int MT>
inline void micro(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy, int64_t cols) {
  __m512 acc[MT][2];
  PDC_UNROLL
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = _mm512_loadu_ps(w + k * P), w1 = _mm512_loadu_ps(w + k * P + 16);
    PDC_UNROLL
    for (int m = 0; m < MT; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
      acc[m][0] = _mm512_fmadd_ps(xb, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(xb, w1, acc[m][1]);
    }
  }
  const __mmask16 lo = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 hi = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  PDC_UNROLL
  for (int m = 0; m < MT; ++m) {
    _mm512_mask_storeu_ps(y + m * ldy, lo, acc[m][0]);
    _mm512_mask_storeu_ps(y + m * ldy + 16, hi, acc[m][1]);
  }
}
#elif defined(PDC_AVX2)
constexpr int MT_MAX = 2;
// the whole panel (4 vectors) for MT <= 2 rows: few rows (decode's small batches), one pass
template <int MT>
inline void micro(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy, int64_t cols) {
  __m256 acc[MT][4];
  PDC_UNROLL
  for (int m = 0; m < MT; ++m) {
    PDC_UNROLL
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    __m256 wv[4];
    PDC_UNROLL
    for (int j = 0; j < 4; ++j) wv[j] = _mm256_loadu_ps(w + k * P + 8 * j);
    PDC_UNROLL
    for (int m = 0; m < MT; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);
      PDC_UNROLL
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_fmadd_ps(xb, wv[j], acc[m][j]);
    }
  }
  alignas(32) float out[P];
  PDC_UNROLL
  for (int m = 0; m < MT; ++m) {
    PDC_UNROLL
    for (int j = 0; j < 4; ++j) _mm256_store_ps(out + 8 * j, acc[m][j]);
    std::copy(out, out + cols, y + m * ldy);
  }
}
// Half a panel (16 output features, cols <= 16 of them valid) for MT <= 6 rows: 12 accumulators,
// 2 weight loads and MT broadcasts per k (BLIS's 6 x 16 Haswell tile); used from 6 rows up.
constexpr int MT_HALF = 6;
constexpr int64_t HALF = 16;
template <int MT>
inline void micro_half(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy,
                       int64_t cols) {
  __m256 acc[MT][2];
  PDC_UNROLL
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(w + k * P), w1 = _mm256_loadu_ps(w + k * P + 8);
    PDC_UNROLL
    for (int m = 0; m < MT; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);
      acc[m][0] = _mm256_fmadd_ps(xb, w0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(xb, w1, acc[m][1]);
    }
  }
  alignas(32) float out[HALF];
  PDC_UNROLL
  for (int m = 0; m < MT; ++m) {
    _mm256_store_ps(out, acc[m][0]);
    _mm256_store_ps(out + 8, acc[m][1]);
    std::copy(out, out + cols, y + m * ldy);
  }
}
#else
constexpr int MT_MAX = 1;
template <int MT>
inline void micro(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy, int64_t cols) {
  for (int m = 0; m < MT; ++m) {
    float acc[P] = {};
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < P; ++j) acc[j] += x[m * ldx + k] * w[k * P + j];
    std::copy(acc, acc + cols, y + m * ldy);
  }
}
#endif

// every input row against one panel, in tiles of MT_MAX rows (then 4, 2, 1); with AVX2, from 6
// rows up, tiles of 6 rows against each half of the panel first
inline void panel_rows(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N, int64_t cols) {
  int64_t m = 0;
#if defined(PDC_AVX2) && !defined(PDC_AVX512)
  for (int64_t h = 0; h < cols && M >= MT_HALF; h += HALF) {
    for (m = 0; m + MT_HALF <= M; m += MT_HALF)
      micro_half<MT_HALF>(x + m * K, K, w + h, K, y + m * N + h, N, std::min(HALF, cols - h));
  }
#endif
  for (; m + MT_MAX <= M; m += MT_MAX) micro<MT_MAX>(x + m * K, K, w, K, y + m * N, N, cols);
  if constexpr (MT_MAX > 4) {
    if (m + 4 <= M) { micro<4>(x + m * K, K, w, K, y + m * N, N, cols); m += 4; }
  }
  if constexpr (MT_MAX > 2) {
    if (m + 2 <= M) { micro<2>(x + m * K, K, w, K, y + m * N, N, cols); m += 2; }
  }
  for (; m < M; ++m) micro<1>(x + m * K, K, w, K, y + m * N, N, cols);
}

}  // namespace

// y = x @ W.T + bias with W packed in panels (see the file comment). x float32 [M, K] (made
// contiguous); panels float32 [ceil(N / 32), K, 32] contiguous; n = N, the real output features
// (<= 32 * panels); bias float32 [N] or None. Returns float32 [M, N]. A bad argument raises
// RuntimeError naming it.
torch::Tensor linear(const torch::Tensor& x_in, const torch::Tensor& panels, int64_t n,
                     const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == torch::kFloat32 && x_in.dim() == 2,
              "panel_gemm.linear: x must be a 2-D CPU float32 tensor [M, K], got ", x_in.scalar_type(), " ",
              x_in.sizes());
  TORCH_CHECK(panels.device().is_cpu() && panels.scalar_type() == torch::kFloat32 && panels.dim() == 3 &&
                  panels.size(2) == P && panels.is_contiguous(),
              "panel_gemm.linear: panels must be a contiguous CPU float32 tensor [N/32, K, 32], got ",
              panels.scalar_type(), " ", panels.sizes());
  TORCH_CHECK(x_in.size(1) == panels.size(1), "panel_gemm.linear: x has K=", x_in.size(1), " but panels have K=",
              panels.size(1));
  TORCH_CHECK(n >= 0 && n <= panels.size(0) * P && n > (panels.size(0) - 1) * P,
              "panel_gemm.linear: n=", n, " does not match ", panels.size(0), " panels of ", P);
  if (bias.has_value())
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == torch::kFloat32 && bias->dim() == 1 &&
                    bias->size(0) == n,
                "panel_gemm.linear: bias must be a CPU float32 tensor [N=", n, "], got ", bias->scalar_type(), " ",
                bias->sizes());
  const torch::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), npanels = panels.size(0);
  torch::Tensor y = torch::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  const torch::Tensor b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // grain: >= ~64 KiB of weights (or ~2 MFLOP) per task, so small matrices do not pay for a fork
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(K * P * std::min<int64_t>(M, 32), 1));
  at::parallel_for(0, npanels, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t m0 = 0; m0 < M; m0 += MB) {  // a block of rows stays in L2 across the task's panels
      const int64_t rows = std::min(MB, M - m0);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t col = p * P, cols = std::min(P, n - col);
        float* yb = yp + m0 * n + col;
        panel_rows(xp + m0 * K, rows, K, wp + p * K * P, yb, n, cols);
        if (bp != nullptr)
          for (int64_t m = 0; m < rows; ++m)
            for (int64_t j = 0; j < cols; ++j) yb[m * n + j] += bp[col + j];
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("linear_abi") =  // decode_step.cpp
      pdc_abi::abi_capsule(pdc_abi::kPanelLinear, &linear);
  m.def("linear", &linear, "y = x @ W.T + bias, W packed in panels of 32 output features [N/32, K, 32]",
        py::arg("x"), py::arg("panels"), py::arg("n"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
}
