// What the integer-dot kernels (w8a8_gemm.cpp, w4a8_gemm.cpp) share: the per-call quantization of the
// activations, the software prefetch of the weight stream, the bias check and the loop over panels, row
// blocks and row tiles. Included after simd.h.
#pragma once

#include "torch_ext.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// AVX-512 VNNI (vpdpbusd: unsigned x signed bytes, 4 products summed into each int32 lane)
#if defined(PDC_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PDC_VNNI512 1
#endif

// Weights are streamed once per call at a few rows: a software prefetch this many bytes ahead of the line
// being multiplied (the next panels' lines near a panel's end: panels are contiguous) keeps more DRAM reads
// in flight than the hardware prefetcher alone. Measured at one row and one thread over SmolLM2's matrices
// streamed from DRAM (int8): 2-4 KiB ahead was best, +5-30% over none (noisy machine).
constexpr int64_t PREFETCH_BYTES = 4096;

#if defined(PDC_AVX2)
// Prefetching past the end of the weights is harmless: a prefetch never faults.
inline void prefetch_ahead(const void* line) {
  _mm_prefetch(static_cast<const char*>(line) + PREFETCH_BYTES, _MM_HINT_T0);
}

// The first `cols` (<= 16) of one row's panel sums, held in two AVX2 registers (outputs 0-7, 8-15), to y.
inline void store_panel_row(__m256 lo, __m256 hi, int64_t cols, float* y) {
  alignas(32) float out[16];
  _mm256_store_ps(out, lo);
  _mm256_store_ps(out + 8, hi);
  std::copy(out, out + cols, y);
}
#endif

// Activations [M, K] -> codes [M, K4] and scales [M, K/G]: per row and group of G features,
// sx = max|x| / 127, qx = round-half-even(x * (1 / sx)) clamped to [-127, 127] (0 and sx = 0 for an all-zero
// group), stored as qx + zero (zero 128: unsigned codes for vpdpbusd's unsigned operand; 0: signed int8 in the
// same bytes); features K..K4 hold `zero`. With `sums` (may be null), sums[m, g] = sx * sum of the group's qx
// (llama.cpp's q8_1 block sum, for the Q4_1 min term). llama.cpp's quantize_row_q8_0 with float32 scales.
inline void quantize_rows(const float* x, int64_t M, int64_t K, int64_t K4, int64_t G, uint8_t zero,
                          uint8_t* codes, float* sx, float* sums) {
  const int64_t ng = K / G;
  for (int64_t m = 0; m < M; ++m) {
    std::memset(codes + m * K4 + K, zero, K4 - K);
    for (int64_t g = 0; g < ng; ++g) {
      const float* xg = x + m * K + g * G;
      uint8_t* c = codes + m * K4 + g * G;
      int64_t k = 0;
      float amax = 0.f;
#if defined(PDC_AVX512)
      __m512 vmax = _mm512_setzero_ps();
      for (; k + 16 <= G; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(xg + k)));
      amax = _mm512_reduce_max_ps(vmax);
#endif
      for (; k < G; ++k) amax = std::max(amax, std::fabs(xg[k]));
      const float s = amax / 127.0f;
      const float inv = s > 0.f ? 1.0f / s : 0.f;
      sx[m * ng + g] = s;
      int32_t total = 0;
      k = 0;
#if defined(PDC_AVX512)
      const __m512 vinv = _mm512_set1_ps(inv);
      __m512i vsum = _mm512_setzero_si512();
      for (; k + 16 <= G; k += 16) {  // cvtps rounds half to even (the default MXCSR mode), as torch.round
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xg + k), vinv));
        q = _mm512_min_epi32(_mm512_max_epi32(q, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
        vsum = _mm512_add_epi32(vsum, q);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(c + k),
                         _mm512_cvtepi32_epi8(_mm512_add_epi32(q, _mm512_set1_epi32(zero))));
      }
      total = _mm512_reduce_add_epi32(vsum);
#endif
      for (; k < G; ++k) {
        const int32_t q = static_cast<int32_t>(std::min(127.f, std::max(-127.f, std::nearbyint(xg[k] * inv))));
        total += q;
        c[k] = static_cast<uint8_t>(q + zero);
      }
      if (sums != nullptr) sums[m * ng + g] = s * static_cast<float>(total);
    }
  }
}

constexpr int64_t PANEL = 16;       // output features per panel: one AVX-512 register of int32 sums
constexpr int64_t ROW_BLOCK = 256;  // input rows per block (prefill)
#if defined(PDC_VNNI512)
constexpr int MT_MAX = 8;  // input rows per tile, sharing each loaded weight vector
#elif defined(PDC_AVX2)
constexpr int MT_MAX = 2;
#else
constexpr int MT_MAX = 1;
#endif

// `n` output features fill `npanels` panels, and `bias` (may be absent) is a CPU float32 [n]; else a
// RuntimeError naming `fn` and the argument.
inline void check_panels_and_bias(const char* fn, int64_t n, int64_t npanels,
                                   const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(n >= 0 && n <= npanels * PANEL && n > (npanels - 1) * PANEL, fn, ": n=", n, " does not match ",
              npanels, " panels of ", PANEL);
  if (bias.has_value())
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == torch::kFloat32 && bias->dim() == 1 &&
                    bias->size(0) == n,
                fn, ": bias must be a CPU float32 tensor [N=", n, "], got ", bias->scalar_type(), " ", bias->sizes());
}

template <int MT, class Kernel>
inline void tiles(const Kernel& k, int64_t& m, int64_t m1, int64_t p, float* yc, int64_t ldy, int64_t cols) {
  for (; m + MT <= m1; m += MT) k.template tile<MT>(m, p, yc + m * ldy, ldy, cols);
}

// y[M, n] (+ bias, may be null): panels split over torch's intra-op threads, each task's rows in blocks of
// ROW_BLOCK and tiles of MT_MAX, 4, 2, 1 rows; k.tile<MT>(m, p, y, ldy, cols) writes rows m .. m + MT - 1 of
// panel p's `cols` outputs at y (row stride ldy). Grain: >= ~32 KiB of weights (`panel_bytes` each) per
// task, fewer panels with more rows, so small matrices do not pay for a fork.
template <class Kernel>
void over_panels(const Kernel& k, int64_t M, int64_t n, int64_t npanels, int64_t panel_bytes, const float* bias,
                 float* y) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(panel_bytes * std::min<int64_t>(M, 8), 1));
  at::parallel_for(0, npanels, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t r0 = 0; r0 < M; r0 += ROW_BLOCK) {
      const int64_t r1 = std::min(M, r0 + ROW_BLOCK);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t col = p * PANEL, cols = std::min(PANEL, n - col);
        float* yc = y + col;
        int64_t m = r0;
        tiles<MT_MAX>(k, m, r1, p, yc, n, cols);
        if constexpr (MT_MAX > 4) tiles<4>(k, m, r1, p, yc, n, cols);
        if constexpr (MT_MAX > 2) tiles<2>(k, m, r1, p, yc, n, cols);
        tiles<1>(k, m, r1, p, yc, n, cols);
        if (bias != nullptr)
          for (int64_t r = r0; r < r1; ++r)
            for (int64_t j = 0; j < cols; ++j) yc[r * n + j] += bias[col + j];
      }
    }
  });
}
