// Q4_1 weights x int8 activations (W4A8, activations quantized per call) for any row count:
//   y[M, N] = sum_g sx[m, g] * (d[n, g] * sum_{k in g} qx[m, k] * qw[n, k] + m[n, g] * sum_{k in g} qx[m, k]) + b[N]
// Weights: llama.cpp's Q4_1 blocks of 32 (codes 0..15, w = d * code + m, d and m float). Activations: quantized
// here in the same blocks of 32 (quantize_rows.h: per row and block, symmetric int8, float scale), with each
// block's code sum kept for the m term. Each block's dot is exact in int32 and scaled once: llama.cpp's
// Q4_1 x Q8_1 dot (ggml_vec_dot_q4_1_q8_1, whose q8_1 block also carries d * sum(qs)).
//
// Layout (engine/kernels/cpu/quant_ops.py packs it): output features in panels of 16, input features in
// octets: wpack[p, r, j, b] = code(16p + j, 8r + b) | code(16p + j, 8r + 4 + b) << 4, [ceil(N/16), K/8, 16, 4]
// uint8 (rows past N are 0); dm[p, g, 0, j] = d(16p + j, g) and dm[p, g, 1, j] = m(16p + j, g),
// [ceil(N/16), K/32, 2, 16] float32. One 64-byte load holds two quads of 4 inputs x 16 outputs: its low
// nibbles the first, its high nibbles the second. With AVX-512 VNNI, vpdpbusd multiplies the unsigned codes
// by the broadcast signed activation quad and adds the 4 products into each output's int32 lane (the
// outer-product form of csrc/panel_gemm.cpp and csrc/w8a8_gemm.cpp); with AVX2 only, vpmaddubsw (codes
// unsigned, activations signed: 15 * 127 * 2 fits its int16 pair sums) then vpmaddwd; else scalar loops.
// Panels are split over torch's intra-op threads; input rows go in tiles of up to 8 (AVX-512) sharing each
// loaded weight vector, and in blocks of 256 rows for prefill.
#include "torch_ext.h"
#include "kernel_abi.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"
#include "int8_dot.h"

namespace {

constexpr int64_t P = PANEL;
constexpr int64_t QK = 32;   // weights per Q4_1 block

struct Args {
  const int8_t* codes;  // [M, K]
  const float* sx;      // [M, ng]
  const float* sums;    // [M, ng]: sx * sum of the block's codes
  int64_t K, ng;
};

// y[m, 0:cols] for MT input rows against one panel (w: [K/8, 16, 4]; dm: [ng, 2, 16]).
template <int MT>
inline void micro(const Args& a, int64_t m0, const uint8_t* w, const float* dm, float* y, int64_t ldy, int64_t cols) {
  const int8_t* xc = a.codes + m0 * a.K;
  const float* sx = a.sx + m0 * a.ng;
  const float* xs = a.sums + m0 * a.ng;
  auto quad = [&](int m, int64_t k) {
    int32_t v;
    std::memcpy(&v, xc + m * a.K + k, 4);
    return v;
  };
#if defined(PDC_VNNI512)
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.ng; ++g) {
    __m512i dp[MT][2];
    for (int m = 0; m < MT; ++m) dp[m][0] = dp[m][1] = _mm512_setzero_si512();
    for (int64_t r = 4 * g; r < 4 * g + 4; ++r) {
      prefetch_ahead(w + r * 64);
      const __m512i v = _mm512_loadu_si512(w + r * 64);
      const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      for (int m = 0; m < MT; ++m) {
        dp[m][0] = _mm512_dpbusd_epi32(dp[m][0], lo, _mm512_set1_epi32(quad(m, 8 * r)));
        dp[m][1] = _mm512_dpbusd_epi32(dp[m][1], hi, _mm512_set1_epi32(quad(m, 8 * r + 4)));
      }
    }
    const __m512 dv = _mm512_loadu_ps(dm + g * 2 * P), mv = _mm512_loadu_ps(dm + g * 2 * P + P);
    for (int m = 0; m < MT; ++m) {
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(dp[m][0], dp[m][1]));
      acc[m] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dv, _mm512_set1_ps(sx[m * a.ng + g])), acc[m]);
      acc[m] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[m * a.ng + g]), acc[m]);
    }
  }
  const __mmask16 mask = cols >= P ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  for (int m = 0; m < MT; ++m) _mm512_mask_storeu_ps(y + m * ldy, mask, acc[m]);
#elif defined(PDC_AVX2)
  const __m256i low = _mm256_set1_epi8(0x0F), ones16 = _mm256_set1_epi16(1);
  __m256 acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.ng; ++g) {
    __m256i dp[MT][2];
    for (int m = 0; m < MT; ++m) dp[m][0] = dp[m][1] = _mm256_setzero_si256();
    for (int64_t r = 4 * g; r < 4 * g + 4; ++r) {
      prefetch_ahead(w + r * 64);
      for (int h = 0; h < 2; ++h) {  // outputs 8h .. 8h + 7
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * 64 + 32 * h));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int m = 0; m < MT; ++m) {
          const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(quad(m, 8 * r))),
                                             _mm256_maddubs_epi16(hi, _mm256_set1_epi32(quad(m, 8 * r + 4))));
          dp[m][h] = _mm256_add_epi32(dp[m][h], _mm256_madd_epi16(s, ones16));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 dv = _mm256_loadu_ps(dm + g * 2 * P + 8 * h), mv = _mm256_loadu_ps(dm + g * 2 * P + P + 8 * h);
      for (int m = 0; m < MT; ++m) {
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp[m][h]), _mm256_mul_ps(dv, _mm256_set1_ps(sx[m * a.ng + g])),
                                    acc[m][h]);
        acc[m][h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[m * a.ng + g]), acc[m][h]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) store_panel_row(acc[m][0], acc[m][1], cols, y + m * ldy);
#else
  (void)quad;
  for (int m = 0; m < MT; ++m)
    for (int64_t j = 0; j < cols; ++j) {
      float acc = 0.f;
      for (int64_t g = 0; g < a.ng; ++g) {
        int32_t t = 0;
        for (int64_t r = 4 * g; r < 4 * g + 4; ++r)
          for (int b = 0; b < 4; ++b) {
            const uint8_t byte = w[r * 64 + 4 * j + b];
            t += (byte & 0x0F) * xc[m * a.K + 8 * r + b] + (byte >> 4) * xc[m * a.K + 8 * r + 4 + b];
          }
        acc += static_cast<float>(t) * dm[g * 2 * P + j] * sx[m * a.ng + g] + dm[g * 2 * P + P + j] * xs[m * a.ng + g];
      }
      y[m * ldy + j] = acc;
    }
#endif
}

// One panel's tiles for over_panels: wpack [npanels, K/8, 16, 4], dm [npanels, ng, 2, 16].
struct Panels {
  Args a;
  const uint8_t* wp;
  const float* dp;
  int64_t K, ng;
  template <int MT>
  void tile(int64_t m, int64_t p, float* y, int64_t ldy, int64_t cols) const {
    micro<MT>(a, m, wp + p * (K / 2) * P, dp + p * ng * 2 * P, y, ldy, cols);
  }
};

}  // namespace

// y = quantize(x) @ dequantize_q4_1(W).T + bias with W packed (see the file comment). x float32 [M, K], K a
// multiple of 32; wpack uint8 [ceil(n/16), K/8, 16, 4]; dm float32 [ceil(n/16), K/32, 2, 16]; n = N; bias
// float32 [N] or None. Returns float32 [M, N]. A bad argument raises RuntimeError naming it.
torch::Tensor linear_w4a8(const torch::Tensor& x_in, const torch::Tensor& wpack, const torch::Tensor& dm,
                          int64_t n, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == torch::kFloat32 && x_in.dim() == 2 &&
                  x_in.size(1) % QK == 0,
              "linear_w4a8: x must be a 2-D CPU float32 tensor [M, K] with K a multiple of 32, got ",
              x_in.scalar_type(), " ", x_in.sizes());
  const int64_t M = x_in.size(0), K = x_in.size(1), ng = K / QK;
  TORCH_CHECK(wpack.device().is_cpu() && wpack.scalar_type() == torch::kUInt8 && wpack.dim() == 4 &&
                  wpack.size(1) == K / 8 && wpack.size(2) == P && wpack.size(3) == 4 && wpack.is_contiguous(),
              "linear_w4a8: wpack must be a contiguous CPU uint8 tensor [N/16, K/8=", K / 8, ", 16, 4], got ",
              wpack.scalar_type(), " ", wpack.sizes());
  const int64_t npanels = wpack.size(0);
  check_panels_and_bias("linear_w4a8", n, npanels, bias);
  TORCH_CHECK(dm.device().is_cpu() && dm.scalar_type() == torch::kFloat32 && dm.dim() == 4 &&
                  dm.size(0) == npanels && dm.size(1) == ng && dm.size(2) == 2 && dm.size(3) == P && dm.is_contiguous(),
              "linear_w4a8: dm must be a contiguous CPU float32 tensor [", npanels, ", K/32=", ng, ", 2, 16], got ",
              dm.scalar_type(), " ", dm.sizes());
  const torch::Tensor x = x_in.contiguous();
  torch::Tensor y = torch::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  std::vector<uint8_t> codes(M * K);
  std::vector<float> sx(M * ng), sums(M * ng);
  quantize_rows(x.data_ptr<float>(), M, K, K, QK, 0, codes.data(), sx.data(), sums.data());
  const Args a{reinterpret_cast<const int8_t*>(codes.data()), sx.data(), sums.data(), K, ng};
  const torch::Tensor b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  const Panels k{a, wpack.data_ptr<uint8_t>(), dm.data_ptr<float>(), K, ng};
  over_panels(k, M, n, npanels, K / 2 * P, b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>());
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("linear_w4a8_abi") =  // decode_step.cpp
      pdc_abi::abi_capsule(pdc_abi::kLinearW4A8, &linear_w4a8);
  m.doc() = "Q4_1 weights x per-call int8 activations (AVX-512 VNNI / AVX2 integer dot over panel-packed nibbles)";
  m.def("linear_w4a8", &linear_w4a8, "y = quantize_int8(x) @ dequantize_q4_1(W).T + bias, W packed in panels",
        py::arg("x"), py::arg("wpack"), py::arg("dm"), py::arg("n"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
}
