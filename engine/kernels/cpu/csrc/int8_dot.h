// What the integer-dot kernels (w8a8_gemm.cpp, w4a8_gemm.cpp) share: the per-call quantization of the
// activations and the software prefetch of the weight stream. Included after simd.h.
#pragma once

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
