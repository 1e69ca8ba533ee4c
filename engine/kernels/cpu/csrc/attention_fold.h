// The arithmetic of the paged attention kernel (paged_attention.cpp), one query row's online softmax
// tile by tile: scores, tile max, exponentials, the running sum and the unnormalised output, and the merge
// of a split context's parts. Kept apart from the kernel's scheduling so that every path through the
// kernel (decode rows, a prompt's rows sharing a block's K/V) folds a row with these same functions: a
// row's result depends on its own context and query only (the "batch-invariant" attention backend).
// Included by paged_attention.cpp only.
#pragma once

#include "torch_ext.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "simd.h"

namespace {  // internal linkage: inlined into paged_attention.cpp, no calls through the PLT

struct Layout {
  int64_t block_size, num_kv_heads, head_dim, group, num_heads;
  int64_t block_stride, token_stride;  // floats between blocks / between tokens of a block
};

struct State {  // one work item's running softmax state and scratch, per query head of its rows
  std::vector<float> q, acc, m, l, s;
  State(const Layout& L, int64_t rows)
      : q(rows * L.head_dim), acc(rows * L.head_dim), m(rows), l(rows), s(L.block_size) {}
  void reset() {
    std::fill(acc.begin(), acc.end(), 0.f);
    std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
    std::fill(l.begin(), l.end(), 0.f);
  }
};

#ifdef PDC_AVX2
// exp(x) for x <= 0 (Cephes expf: range reduction by ln 2, degree-5 polynomial; ~2 ulp).
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// scores() for four rows at once: each row's sum exactly as scores()' one-row loop forms it (the same two
// accumulators, then hsum's pairing: lanes j + (j+4), then (0 + 2) + (1 + 3)), the four horizontal sums
// done together in shuffles instead of four dependent chains: bit-identical (checked with torch.equal on
// the kernel's outputs before and after, batch 1-8, contexts 64-1024), 5-15% less attention time here.
inline void scores4(const float* q, const float* k, int64_t stride, int64_t d, float* s) {
  __m256 a0[4], a1[4];
  for (int j = 0; j < 4; ++j) a0[j] = a1[j] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    const __m256 qa = _mm256_loadu_ps(q + i), qb = _mm256_loadu_ps(q + i + 8);
    for (int j = 0; j < 4; ++j) {
      a0[j] = _mm256_fmadd_ps(qa, _mm256_loadu_ps(k + j * stride + i), a0[j]);
      a1[j] = _mm256_fmadd_ps(qb, _mm256_loadu_ps(k + j * stride + i + 8), a1[j]);
    }
  }
  if (i < d)
    for (int j = 0; j < 4; ++j)
      a0[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + j * stride + i), a0[j]);
  __m256 c[4];
  for (int j = 0; j < 4; ++j) c[j] = _mm256_add_ps(a0[j], a1[j]);
  // z: lanes j + (j+4) of rows 0 | 1 (z01) and 2 | 3 (z23), one row per 128-bit half
  const __m256 z01 = _mm256_add_ps(_mm256_permute2f128_ps(c[0], c[1], 0x20), _mm256_permute2f128_ps(c[0], c[1], 0x31));
  const __m256 z23 = _mm256_add_ps(_mm256_permute2f128_ps(c[2], c[3], 0x20), _mm256_permute2f128_ps(c[2], c[3], 0x31));
  // each half as (z0, z2, z1, z3): hadd pairs 0 + 2 and 1 + 3, the second hadd adds those two
  const __m256 h = _mm256_hadd_ps(_mm256_permute_ps(z01, 0xD8), _mm256_permute_ps(z23, 0xD8));
  alignas(32) float out[8];
  _mm256_store_ps(out, _mm256_hadd_ps(h, h));  // rows 0, 2, 0, 2 | 1, 3, 1, 3
  s[0] = out[0], s[1] = out[4], s[2] = out[1], s[3] = out[5];
}

// s[t] = <q, k_t> for the n rows k_0.. (stride floats apart); head_dim % 8 == 0.
void scores(const float* q, const float* k, int64_t n, int64_t stride, int64_t d, float* s) {
#if defined(PDC_AVX512)
  if (d % 16 == 0) {  // 16 lanes per FMA: half the instructions of the AVX2 loop below
    for (int64_t t = 0; t < n; ++t, k += stride) {
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
      int64_t i = 0;
      for (; i + 32 <= d; i += 32) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i + 16), _mm512_loadu_ps(k + i + 16), a1);
      }
      if (i < d) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), a0);
      s[t] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    }
    return;
  }
#endif
  int64_t t = 0;
  for (; t + 4 <= n; t += 4, k += 4 * stride) scores4(q, k, stride, d, s + t);
  for (; t < n; ++t, k += stride) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), _mm256_loadu_ps(k + i + 8), a1);
    }
    if (i < d) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), a0);
    s[t] = hsum(_mm256_add_ps(a0, a1));
  }
}

// acc[0:8*NV] = acc * alpha + sum_t p[t] * v_t[0:8*NV], the accumulator held in registers.
template <int NV>
void accumulate_chunk(float* acc, float alpha, const float* p, const float* v, int64_t n, int64_t stride) {
  __m256 a[NV];
  const __m256 al = _mm256_set1_ps(alpha);
  for (int j = 0; j < NV; ++j) a[j] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * j), al);
  for (int64_t t = 0; t < n; ++t, v += stride) {
    const __m256 pt = _mm256_set1_ps(p[t]);
    for (int j = 0; j < NV; ++j) a[j] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 8 * j), a[j]);
  }
  for (int j = 0; j < NV; ++j) _mm256_storeu_ps(acc + 8 * j, a[j]);
}

#if defined(PDC_AVX512)
// accumulate_chunk with 16 lanes per register: acc[0:16*NV].
template <int NV>
void accumulate_chunk16(float* acc, float alpha, const float* p, const float* v, int64_t n, int64_t stride) {
  __m512 a[NV];
  const __m512 al = _mm512_set1_ps(alpha);
  for (int j = 0; j < NV; ++j) a[j] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * j), al);
  for (int64_t t = 0; t < n; ++t, v += stride) {
    const __m512 pt = _mm512_set1_ps(p[t]);
    for (int j = 0; j < NV; ++j) a[j] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v + 16 * j), a[j]);
  }
  for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + 16 * j, a[j]);
}
#endif

void accumulate(float* acc, float alpha, const float* p, const float* v, int64_t n, int64_t stride, int64_t d) {
  int64_t c = 0;
#if defined(PDC_AVX512)
  for (; c + 64 <= d; c += 64) accumulate_chunk16<4>(acc + c, alpha, p, v + c, n, stride);
  for (; c + 16 <= d; c += 16) accumulate_chunk16<1>(acc + c, alpha, p, v + c, n, stride);
#endif
  for (; c + 64 <= d; c += 64) accumulate_chunk<8>(acc + c, alpha, p, v + c, n, stride);
  switch ((d - c) / 8) {
    case 1: accumulate_chunk<1>(acc + c, alpha, p, v + c, n, stride); break;
    case 2: accumulate_chunk<2>(acc + c, alpha, p, v + c, n, stride); break;
    case 3: accumulate_chunk<3>(acc + c, alpha, p, v + c, n, stride); break;
    case 4: accumulate_chunk<4>(acc + c, alpha, p, v + c, n, stride); break;
    case 5: accumulate_chunk<5>(acc + c, alpha, p, v + c, n, stride); break;
    case 6: accumulate_chunk<6>(acc + c, alpha, p, v + c, n, stride); break;
    case 7: accumulate_chunk<7>(acc + c, alpha, p, v + c, n, stride); break;
    default: break;
  }
}

// p[t] = exp(s[t] - m) in place; returns sum_t p[t].
float exp_sum(float* s, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
    _mm256_storeu_ps(s + t, p);
    sum = _mm256_add_ps(sum, p);
  }
  float total = hsum(sum);
  for (; t < n; ++t) total += (s[t] = std::exp(s[t] - m));
  return total;
}
#else
void scores(const float* q, const float* k, int64_t n, int64_t stride, int64_t d, float* s) {
  for (int64_t t = 0; t < n; ++t, k += stride) {
    float a = 0.f;
    for (int64_t i = 0; i < d; ++i) a += q[i] * k[i];
    s[t] = a;
  }
}

void accumulate(float* acc, float alpha, const float* p, const float* v, int64_t n, int64_t stride, int64_t d) {
  for (int64_t i = 0; i < d; ++i) acc[i] *= alpha;
  for (int64_t t = 0; t < n; ++t, v += stride)
    for (int64_t i = 0; i < d; ++i) acc[i] += p[t] * v[i];
}

float exp_sum(float* s, int64_t n, float m) {
  float total = 0.f;
  for (int64_t t = 0; t < n; ++t) total += (s[t] = std::exp(s[t] - m));
  return total;
}
#endif

// Fold n context tokens of one block (k, v: the first token's row of one kv head) into the
// state's query rows [row0, row0 + group).
void fold_tile(State& st, const Layout& L, int64_t row0, const float* k, const float* v, int64_t n) {
  const int64_t d = L.head_dim;
  float* s = st.s.data();
  for (int64_t r = row0; r < row0 + L.group; ++r) {
    scores(st.q.data() + r * d, k, n, L.token_stride, d, s);
    const float tile_max = *std::max_element(s, s + n);
    const float m_new = std::max(st.m[r], tile_max);
    const float alpha = std::exp(st.m[r] - m_new);  // 0 on the first tile (m = -inf)
    st.l[r] = st.l[r] * alpha + exp_sum(s, n, m_new);
    st.m[r] = m_new;
    accumulate(st.acc.data() + r * d, alpha, s, v, n, L.token_stride, d);
  }
}

// Ask for the rows of kv heads [h0, h0 + nh) of the first n tokens of the block at base (K and V)
// while the current block is folded.
void prefetch_tile(const Layout& L, const float* kc, const float* vc, int64_t base, int64_t n, int64_t h0, int64_t nh) {
#ifdef PDC_AVX2
  const char* k = reinterpret_cast<const char*>(kc + base + h0 * L.head_dim);
  const char* v = reinterpret_cast<const char*>(vc + base + h0 * L.head_dim);
  const int64_t row = nh * L.head_dim * 4, stride = L.token_stride * 4;
  for (int64_t t = 0; t < n; ++t, k += stride, v += stride)
    for (int64_t b = 0; b < row; b += 64) {
      _mm_prefetch(k + b, _MM_HINT_T0);
      _mm_prefetch(v + b, _MM_HINT_T0);
    }
#endif
}

// Contexts longer than kPartTokens are attended in parts of kPartTokens (the last part shorter), each its own
// work item, whose softmax states are merged at the end (Flash-Decoding's split-K; vLLM's paged attention
// v2 partitions likewise by 512 tokens). The parts depend on a sequence's own context only, never on the
// batch or the thread count, so a sequence's output is the same whatever it is batched with (migration and
// seeded sampling rely on that). What it buys: at batch 1 the items are only the kv heads (SmolLM2: 3 for
// 2 threads, one thread doing two); at context 1024 the parts make 6, shared evenly.
constexpr int64_t kPartTokens = 512;

// out rows = the parts' states merged: softmax over the union of their contexts (each part's
// running max m, sum of exponentials l and unnormalised output acc; an empty part has l = 0).
void combine(const float* m, const float* l, const float* acc, int64_t parts, int64_t rows, int64_t d, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < parts; ++p)
      if (l[p * rows + r] > 0.f) mx = std::max(mx, m[p * rows + r]);
    float total = 0.f;
    for (int64_t i = 0; i < d; ++i) out[r * d + i] = 0.f;
    for (int64_t p = 0; p < parts; ++p) {
      if (l[p * rows + r] <= 0.f) continue;
      const float w = std::exp(m[p * rows + r] - mx);
      total += w * l[p * rows + r];
      const float* a = acc + (p * rows + r) * d;
      for (int64_t i = 0; i < d; ++i) out[r * d + i] += w * a[i];
    }
    const float inv = 1.f / total;
    for (int64_t i = 0; i < d; ++i) out[r * d + i] *= inv;
  }
}

}  // namespace
