// int8 weights x int8 activations (W8A8, activations quantized per call) for any row count:
//   y[M, N] = sum_g sw[n, g] * sx[m, g] * sum_{k in group g} qx[m, k] * qw[n, k]  + b[N]
// Weights: symmetric int8, one float scale per group of G consecutive input weights of a row (G = K / ng).
// Activations: quantized here with the same groups (int8_dot.h: sx = max|x[m, group]| / 127,
// qx = round-half-even(x * (1 / sx)) clamped to [-127, 127], 0 and sx = 0 for an all-zero group). Each
// group's dot is exact in int32 and scaled once. This is llama.cpp's Q8_0 x Q8_0 dot (ggml-cpu: the
// activations are quantized to q8 blocks for the integer dot) with this project's groups and float32 scales.
//
// Layout (engine/kernels/cpu/quant_ops.py packs it): output features in panels of 16, and within a panel
// the input features in quads: wpack[p, q, j, b] = qw[16p + j, 4q + b], [ceil(N/16), K4/4, 16, 4] int8
// (K4 = K rounded up to 4, padding and rows past N are 0); spack[p, g, j] = sw[16p + j, g] float32 and
// excess[p, g, j] = 128 * sum_{k in g} qw[16p + j, k] int32, both [ceil(N/16), ng, 16].
// Per quad q, one 64-byte vector holds 4 weights of each of 16 outputs: with AVX-512 VNNI, vpdpbusd of
// the broadcast 4 codes of an input row adds the 4 products into each output's int32 lane (the
// outer-product form of csrc/panel_gemm.cpp: no horizontal sums). vpdpbusd multiplies unsigned by signed
// bytes, so the codes are stored as qx + 128 and the group's excess 128 * sum(w) is taken off before its
// scale is applied: sx[m, g] * spack[p, g, :] (a vector) times the int32 lanes, FMA'd into float sums.
// With AVX2 only: vpmaddubsw of |qx| and w with qx's sign (vpsignb) then vpmaddwd (llama.cpp's
// mul_sum_i8_pairs; |qx|, |w| <= 127 keep its int16 pair sums from saturating). Else scalar loops.
// Panels are split over torch's intra-op threads (at::parallel_for); input rows go in tiles of up to 8
// (AVX-512) sharing each loaded weight vector, and in blocks of 256 rows for prefill.
#include "torch_ext.h"
#include "kernel_abi.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"
#include "int8_dot.h"

namespace {

constexpr int64_t P = PANEL;

struct Args {
  const uint8_t* codes;  // [M, K4]
  const float* sx;       // [M, ng]
  int64_t K4, ng, quads_per_group;
};

// y[m, 0:cols] for MT input rows against one panel (w: [K4/4, 16, 4]; sw, ex: [ng, 16]).
template <int MT>
inline void micro(const Args& a, int64_t m0, const int8_t* w, const float* sw, const int32_t* ex, float* y,
                  int64_t ldy, int64_t cols) {
  const uint8_t* xc = a.codes + m0 * a.K4;
  const float* sx = a.sx + m0 * a.ng;
#if defined(PDC_VNNI512)
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.ng; ++g) {
    // C independent chains per row (vpdpbusd's latency would bound one chain at few rows)
    constexpr int C = MT == 1 ? 4 : MT == 2 ? 2 : 1;
    __m512i dp[MT][C];
    for (int m = 0; m < MT; ++m)
      for (int c = 0; c < C; ++c) dp[m][c] = _mm512_setzero_si512();
    const int64_t q0 = g * a.quads_per_group, q1 = q0 + a.quads_per_group;
    int64_t q = q0;
    auto quad_at = [&](int m, int64_t qq) {
      int32_t v;
      std::memcpy(&v, xc + m * a.K4 + 4 * qq, 4);
      return _mm512_set1_epi32(v);
    };
    for (; q + C <= q1; q += C)
      for (int c = 0; c < C; ++c) {
        prefetch_ahead(w + (q + c) * 64);
        const __m512i wv = _mm512_loadu_si512(w + (q + c) * 64);
        for (int m = 0; m < MT; ++m) dp[m][c] = _mm512_dpbusd_epi32(dp[m][c], quad_at(m, q + c), wv);
      }
    for (; q < q1; ++q) {
      const __m512i wv = _mm512_loadu_si512(w + q * 64);
      for (int m = 0; m < MT; ++m) dp[m][0] = _mm512_dpbusd_epi32(dp[m][0], quad_at(m, q), wv);
    }
    for (int m = 0; m < MT; ++m)
      for (int c = 1; c < C; ++c) dp[m][0] = _mm512_add_epi32(dp[m][0], dp[m][c]);
    const __m512i exv = _mm512_loadu_si512(ex + g * P);
    const __m512 swv = _mm512_loadu_ps(sw + g * P);
    for (int m = 0; m < MT; ++m)
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dp[m][0], exv)),
                               _mm512_mul_ps(swv, _mm512_set1_ps(sx[m * a.ng + g])), acc[m]);
  }
  const __mmask16 mask = cols >= P ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  for (int m = 0; m < MT; ++m) _mm512_mask_storeu_ps(y + m * ldy, mask, acc[m]);
#elif defined(PDC_AVX2)
  // The two 8-output halves in separately named arrays, not one [MT][2]: indexed by a loop over the halves,
  // GCC kept a half's int32 sums in memory, a store-to-load round trip on every quad (perf: ~2x the time).
  (void)ex;
  __m256 acc0[MT], acc1[MT];
  for (int m = 0; m < MT; ++m) acc0[m] = acc1[m] = _mm256_setzero_ps();
  const __m256i ones16 = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < a.ng; ++g) {
    __m256i dp0[MT], dp1[MT];
    for (int m = 0; m < MT; ++m) dp0[m] = dp1[m] = _mm256_setzero_si256();
    const int64_t q0 = g * a.quads_per_group, q1 = q0 + a.quads_per_group;
    for (int64_t q = q0; q < q1; ++q) {
      prefetch_ahead(w + q * 64);
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + q * 64));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + q * 64 + 32));
      for (int m = 0; m < MT; ++m) {
        int32_t quad;
        std::memcpy(&quad, xc + m * a.K4 + 4 * q, 4);
        const __m256i xb = _mm256_set1_epi32(quad), ax = _mm256_abs_epi8(xb);
        dp0[m] = _mm256_add_epi32(dp0[m],
                                  _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, xb)), ones16));
        dp1[m] = _mm256_add_epi32(dp1[m],
                                  _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, xb)), ones16));
      }
    }
    const __m256 sw0 = _mm256_loadu_ps(sw + g * P), sw1 = _mm256_loadu_ps(sw + g * P + 8);
    for (int m = 0; m < MT; ++m) {
      const __m256 s = _mm256_set1_ps(sx[m * a.ng + g]);
      acc0[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp0[m]), _mm256_mul_ps(sw0, s), acc0[m]);
      acc1[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp1[m]), _mm256_mul_ps(sw1, s), acc1[m]);
    }
  }
  for (int m = 0; m < MT; ++m) store_panel_row(acc0[m], acc1[m], cols, y + m * ldy);
#else
  (void)ex;
  for (int m = 0; m < MT; ++m)
    for (int64_t j = 0; j < cols; ++j) {
      float acc = 0.f;
      for (int64_t g = 0; g < a.ng; ++g) {
        int32_t t = 0;
        for (int64_t q = g * a.quads_per_group; q < (g + 1) * a.quads_per_group; ++q)
          for (int b = 0; b < 4; ++b)
            t += static_cast<int32_t>(static_cast<int8_t>(xc[m * a.K4 + 4 * q + b])) * w[q * 64 + 4 * j + b];
        acc += static_cast<float>(t) * sw[g * P + j] * sx[m * a.ng + g];
      }
      y[m * ldy + j] = acc;
    }
#endif
}

// One panel's tiles for over_panels: wpack [npanels, K4/4, 16, 4], spack / excess [npanels, ng, 16].
struct Panels {
  Args a;
  const int8_t* wp;
  const float* sp;
  const int32_t* ep;
  int64_t K4, ng;
  template <int MT>
  void tile(int64_t m, int64_t p, float* y, int64_t ldy, int64_t cols) const {
    micro<MT>(a, m, wp + p * K4 * P, sp + p * ng * P, ep + p * ng * P, y, ldy, cols);
  }
};

}  // namespace

// y = quantize(x) @ W.T + bias with W packed (see the file comment). x float32 [M, K]; wpack int8
// [ceil(n/16), K4/4, 16, 4]; spack float32 and excess int32 [ceil(n/16), ng, 16] (ng divides K); n = N;
// bias float32 [N] or None. Returns float32 [M, N]. A bad argument raises RuntimeError naming it.
torch::Tensor linear_w8a8(const torch::Tensor& x_in, const torch::Tensor& wpack, const torch::Tensor& spack,
                          const torch::Tensor& excess, int64_t n, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == torch::kFloat32 && x_in.dim() == 2,
              "linear_w8a8: x must be a 2-D CPU float32 tensor [M, K], got ", x_in.scalar_type(), " ", x_in.sizes());
  const int64_t M = x_in.size(0), K = x_in.size(1), K4 = (K + 3) / 4 * 4;
  TORCH_CHECK(wpack.device().is_cpu() && wpack.scalar_type() == torch::kInt8 && wpack.dim() == 4 &&
                  wpack.size(1) == K4 / 4 && wpack.size(2) == P && wpack.size(3) == 4 && wpack.is_contiguous(),
              "linear_w8a8: wpack must be a contiguous CPU int8 tensor [N/16, K4/4=", K4 / 4, ", 16, 4], got ",
              wpack.scalar_type(), " ", wpack.sizes());
  const int64_t npanels = wpack.size(0);
  check_panels_and_bias("linear_w8a8", n, npanels, bias);
  TORCH_CHECK(spack.device().is_cpu() && spack.scalar_type() == torch::kFloat32 && spack.dim() == 3 &&
                  spack.size(0) == npanels && spack.size(1) >= 1 && K % spack.size(1) == 0 && spack.size(2) == P &&
                  spack.is_contiguous(),
              "linear_w8a8: spack must be a contiguous CPU float32 tensor [", npanels, ", ng, 16] with ng dividing K=",
              K, ", got ", spack.scalar_type(), " ", spack.sizes());
  TORCH_CHECK(excess.device().is_cpu() && excess.scalar_type() == torch::kInt32 && excess.sizes() == spack.sizes() &&
                  excess.is_contiguous(),
              "linear_w8a8: excess must be a contiguous CPU int32 tensor ", spack.sizes(), ", got ",
              excess.scalar_type(), " ", excess.sizes());
  const int64_t ng = spack.size(1), G = K / ng;
  TORCH_CHECK(ng == 1 || G % 4 == 0, "linear_w8a8: groups of ", G, " weights must be a multiple of 4");
  const torch::Tensor x = x_in.contiguous();
  torch::Tensor y = torch::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  std::vector<uint8_t> codes(M * K4);
  std::vector<float> sx(M * ng);
#if defined(PDC_VNNI512)
  constexpr uint8_t zero = 128;  // vpdpbusd's unsigned operand
#else
  constexpr uint8_t zero = 0;
#endif
  quantize_rows(x.data_ptr<float>(), M, K, K4, G, zero, codes.data(), sx.data(), nullptr);
  const Args a{codes.data(), sx.data(), K4, ng, ng == 1 ? K4 / 4 : G / 4};
  const torch::Tensor b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  const Panels k{a, wpack.data_ptr<int8_t>(), spack.data_ptr<float>(), excess.data_ptr<int32_t>(), K4, ng};
  over_panels(k, M, n, npanels, K4 * P, b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>());
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("linear_w8a8_abi") =  // decode_step.cpp
      pdc_abi::abi_capsule(pdc_abi::kLinearW8A8, &linear_w8a8);
  m.doc() = "int8 weights x per-call int8 activations (AVX-512 VNNI / AVX2 integer dot over panel-packed weights)";
  m.def("linear_w8a8", &linear_w8a8, "y = quantize_int8(x) @ W.T + bias, W int8 packed in panels of 16 x 4",
        py::arg("x"), py::arg("wpack"), py::arg("spack"), py::arg("excess"), py::arg("n"),
        py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
}
