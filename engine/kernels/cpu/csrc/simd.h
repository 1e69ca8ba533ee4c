// What the C++ CPU kernels share: the vector instruction sets the build machine has
// (-march=native: PDC_AVX2 for AVX2+FMA, PDC_AVX512 for AVX-512F on top) and the horizontal
// sum of an AVX2 register. Included by every kernel in this folder; engine/kernels/cpu/build.py
// rebuilds them all when it changes.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDC_AVX2 1
#endif
#if defined(PDC_AVX2) && defined(__AVX512F__)
#define PDC_AVX512 1
#endif

#ifdef PDC_AVX2
// The sum of v's 8 lanes.
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif
