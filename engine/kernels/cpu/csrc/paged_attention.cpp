// Paged decode attention on CPU: one query token per sequence over the paged KV cache,
// K/V read in place through the block table (no gathered copy of the context).
//
// Algorithm: Flash-Decoding's online softmax (Dao, Haziza, Massa, Sizov, "Flash-Decoding for
// long-context inference", 2023; FlashAttention-2's inner loop) as in vLLM's CPU paged attention
// (csrc/cpu/attention.cpp, paged_attention_v1): one work item per (sequence, kv head) folds the
// context block by block into a running max, a running sum of exponentials and an unnormalised
// output. Grouped-query attention: the item computes all num_heads / num_kv_heads query heads of
// its group together, so each K/V row is read once per group and never repeated per query head.
// AVX2/FMA over head_dim (a scalar path where AVX2 is missing); at::parallel_for over the items
// splits them over torch's intra-op threads. Contexts longer than 512 tokens are also split into
// parts whose states are merged at the end (Flash-Decoding's split-K; see kPartTokens). float32
// throughout.
#include "torch_ext.h"
#include "kernel_abi.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

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
    for (int j = 0; j < 4; ++j) a0[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + j * stride + i), a0[j]);
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

// One work item: kv heads [h0, h0 + nh) of one sequence over context positions [start, end),
// block by block through table (all nh heads of a block in turn: the block's rows are read in
// memory order). q / out: the item's first query head row.
void attend_item(State& st, const Layout& L, const float* q, const float* kc, const float* vc,
                 const int32_t* table, int64_t start, int64_t end, int64_t h0, int64_t nh, float scale, float* out) {
  const int64_t d = L.head_dim, rows = nh * L.group;
  for (int64_t i = 0; i < rows * d; ++i) st.q[i] = q[i] * scale;
  st.reset();
  for (int64_t pos = start; pos < end;) {
    const int64_t blk = table[pos / L.block_size], off = pos % L.block_size;
    const int64_t n = std::min(L.block_size - off, end - pos);
    const int64_t base = blk * L.block_stride + off * L.token_stride;
    const int64_t next = pos + n;
    if (next < end) prefetch_tile(L, kc, vc, table[next / L.block_size] * L.block_stride, std::min(L.block_size, end - next), h0, nh);
    for (int64_t h = 0; h < nh; ++h)
      fold_tile(st, L, h * L.group, kc + base + (h0 + h) * d, vc + base + (h0 + h) * d, n);
    pos += n;
  }
  if (out == nullptr) return;  // a context split: the caller keeps the state for combine()
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / st.l[r];
    for (int64_t i = 0; i < d; ++i) out[r * d + i] = st.acc[r * d + i] * inv;
  }
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

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bt,
                  const at::Tensor& lens) {
  TORCH_CHECK_VALUE(q.dim() == 3 && k.dim() == 4 && k.sizes() == v.sizes(),
                    "need q [B, H, D] and k/v caches [num_blocks, block_size, KH, D] of equal shape");
  TORCH_CHECK_VALUE(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
                    "q, k_cache and v_cache must be float32");
  TORCH_CHECK_VALUE(bt.scalar_type() == at::kInt && lens.scalar_type() == at::kInt,
                    "block_tables and seq_lens must be int32");
  TORCH_CHECK_VALUE(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && bt.is_contiguous() &&
                    lens.is_contiguous(), "all inputs must be contiguous");
  TORCH_CHECK_VALUE(q.device().is_cpu() && k.device().is_cpu(), "inputs must be CPU tensors");
  TORCH_CHECK_VALUE(q.size(2) == k.size(3), "q head_dim ", q.size(2), " != cache head_dim ", k.size(3));
  TORCH_CHECK_VALUE(q.size(1) % k.size(2) == 0, "num_heads ", q.size(1), " not a multiple of num_kv_heads ", k.size(2));
  TORCH_CHECK_VALUE(bt.dim() == 2 && lens.dim() == 1 && bt.size(0) == q.size(0) && lens.size(0) == q.size(0),
                    "need block_tables [B, max_blocks] and seq_lens [B] for B = ", q.size(0));
}

// Every sequence's length in [1, max_blocks * block_size] and its used block ids in [0, num_blocks).
void check_tables(const at::Tensor& bt, const at::Tensor& lens, int64_t block_size, int64_t num_blocks) {
  const int32_t* t = bt.data_ptr<int32_t>();
  const int32_t* n = lens.data_ptr<int32_t>();
  const int64_t max_blocks = bt.size(1);
  for (int64_t b = 0; b < lens.size(0); ++b) {
    TORCH_CHECK_VALUE(n[b] >= 1 && n[b] <= max_blocks * block_size, "seq_lens[", b, "] = ", n[b],
                      " outside [1, ", max_blocks * block_size, "]");
    for (int64_t i = 0; i < (n[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK_VALUE(t[b * max_blocks + i] >= 0 && t[b * max_blocks + i] < num_blocks, "block_tables[", b, ", ", i,
                        "] = ", t[b * max_blocks + i], " outside [0, ", num_blocks, ")");
  }
}

}  // namespace

// out[b, h] = softmax(scale * q[b, h] . K_b^T) V_b over sequence b's last min(seq_lens[b], window)
// context tokens (all of them when window <= 0), K_b/V_b read from kv head h / (H / KH) through
// block_tables[b]. heads_per_item: kv heads per work item (a divisor of KH). Shapes: q [B, H, D];
// caches [num_blocks, block_size, KH, D]; block_tables [B, max_blocks] int32; seq_lens [B] int32
// (tokens, >= 1). Returns [B, H, D] float32.
// Raises ValueError on dtypes, shapes, non-contiguous inputs, head_dim % 8 != 0 on AVX2, a
// heads_per_item not dividing KH, or lengths / block ids out of range.
at::Tensor decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                  int64_t heads_per_item) {
  check_inputs(q, k_cache, v_cache, block_tables, seq_lens);
  const int64_t kh = k_cache.size(2), d = k_cache.size(3), bs = k_cache.size(1);
#ifdef PDC_AVX2
  TORCH_CHECK_VALUE(d % 8 == 0, "head_dim must be a multiple of 8, got ", d);
#endif
  check_tables(block_tables, seq_lens, bs, k_cache.size(0));
  const Layout L{bs, kh, d, q.size(1) / kh, q.size(1), bs * kh * d, kh * d};
  auto out = at::empty_like(q);
  const float *qp = q.data_ptr<float>(), *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  const int32_t *bt = block_tables.data_ptr<int32_t>(), *lens = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const int64_t max_blocks = block_tables.size(1);
  // one kv head per item unless asked otherwise: as fast as whole sequences here (measured at
  // batch 32 x context 1024, SmolLM2's 3 kv heads) and more items to share out
  const int64_t nh = heads_per_item;
  TORCH_CHECK_VALUE(nh >= 1 && kh % nh == 0, "heads_per_item ", nh, " must divide num_kv_heads ", kh);
  const int64_t groups = kh / nh, items = q.size(0) * groups, rows = nh * L.group;
  int64_t max_len = 0;
  for (int64_t b = 0; b < q.size(0); ++b)
    max_len = std::max<int64_t>(max_len, window > 0 ? std::min<int64_t>(lens[b], window) : lens[b]);
  const int64_t splits = (max_len + kPartTokens - 1) / kPartTokens;  // parts of the longest context
  // per (item, part): m and l per row, acc per row (only when some context has several parts)
  std::vector<float> pm(splits > 1 ? items * splits * rows : 0), pl(pm.size()), pacc(pm.size() * d);
  // item = (sequence b, kv heads from h0): offset of its first query head's row in q and out
  auto first_row = [&](int64_t b, int64_t h0) { return (b * L.num_heads + h0 * L.group) * d; };
  at::parallel_for(0, items * splits, 1, [&](int64_t begin, int64_t end) {
    State st(L, rows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t item = task / splits, part = task % splits;
      const int64_t b = item / groups, h0 = (item % groups) * nh, len = lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(len - window, 0) : 0;
      const int64_t row = first_row(b, h0);
      if (splits == 1) {
        attend_item(st, L, qp + row, kc, vc, bt + b * max_blocks, start, len, h0, nh, static_cast<float>(scale),
                    op + row);
        continue;
      }
      // part p of [start, len): kPartTokens from start on (empty past the sequence's own parts)
      const int64_t lo = std::min(len, start + part * kPartTokens), hi = std::min(len, lo + kPartTokens);
      attend_item(st, L, qp + row, kc, vc, bt + b * max_blocks, lo, hi, h0, nh, static_cast<float>(scale), nullptr);
      const int64_t at = (item * splits + part) * rows;
      for (int64_t r = 0; r < rows; ++r) {
        pm[at + r] = st.m[r];
        pl[at + r] = lo < hi ? st.l[r] : 0.f;
      }
      std::copy(st.acc.begin(), st.acc.begin() + rows * d, pacc.begin() + at * d);
    }
  });
  if (splits > 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t at = item * splits * rows;
      combine(pm.data() + at, pl.data() + at, pacc.data() + at * d, splits, rows, d,
              op + first_row(item / groups, (item % groups) * nh));
    }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("decode_abi") =  // decode_step.cpp
      pdc_abi::abi_capsule(pdc_abi::kPagedDecode, &decode);
  m.def("decode", &decode, "Paged decode attention (float32, CPU; see the source's comment)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("window"), py::arg("heads_per_item") = 1,
        py::call_guard<py::gil_scoped_release>());
}
