// Weight-only GGUF Q4_1 skinny matmul for batch-1..16 decode: y[M, N] = x[M, K] @ W[N, K]^T + b[N]
// with W stored quantized and dequantized in registers (never materialized), so each step reads
// 0.75 byte per weight instead of 4. (int8 weights are multiplied in integers: csrc/w8a8_gemm.cpp.)
//
// GGUF/ggml Q4_1 (ggml-quants.c, block_q4_1: 32 weights per block, 4-bit unsigned quants, a float
// scale d and offset m; element j < 16 is the low nibble of byte j, element j >= 16 the high nibble of
// byte j - 16; weight = d * q + m). Per block dot(x_b, w_b) = dot(x_b, d * q_b) + m * sum(x_b): the
// block is decoded to d * q in registers once and dotted with every input row; the offset term uses
// each block's sum of x, computed once per call.
// AVX-512 is used where the build machine has it (-march=native), else AVX2+FMA, else scalar loops.
// Output features are split over torch's intra-op threads (at::parallel_for); any M works (input rows
// are processed in register tiles of up to 4 that reuse the decoded weights).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

int64_t grain_for(int64_t row_bytes, int64_t rows_per_task) {
  // >= ~32 KiB of weights per task: small matrices do not pay for a thread fork
  return std::max<int64_t>(1, (32768 / std::max<int64_t>(row_bytes, 1)) / rows_per_task);
}

void check_x(const char* fn, const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2, fn,
              ": x must be a 2-D CPU float32 tensor [M, K], got ", x.scalar_type(), " ", x.sizes());
}

void check_vec(const char* fn, const char* name, const c10::optional<torch::Tensor>& t, int64_t n) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kFloat32 && t->dim() == 1 && t->size(0) == n,
              fn, ": ", name, " must be a CPU float32 tensor [N=", n, "], got ", t->scalar_type(), " ", t->sizes());
}

// ---------------------------------------------------------------------------------------- Q4_1
constexpr int64_t QK = 32;

// dot over one row of Q4_1 blocks with MT input rows: out[m] = sum_b d_b * dot(x_b, q_b) + m_b * xsum[m][b]
template <int MT>
inline void row_q4_1(const float* x, int64_t K, const float* xsum, const uint8_t* qs, const float* d,
                     const float* mn, float* out) {
  const int64_t nb = K / QK;
  float acc_s[MT] = {};
#if defined(PDC_AVX512)
  __m512 acc[MT][4];  // 4 chains per input row: blocks b (0, 1) and b + 1 (2, 3)
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = _mm512_setzero_ps();
  const __m128i mask = _mm_set1_epi8(0x0F);
  int64_t b = 0;
  auto block = [&](int64_t bb, int u) {
    // decode the block once (quants scaled by d: elements 0-15, 16-31), then 2 FMAs per input row
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + bb * 16));
    const __m512 db = _mm512_set1_ps(d[bb]);
    const __m512 q0 = _mm512_mul_ps(db, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, mask))));
    const __m512 q1 = _mm512_mul_ps(db, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                            _mm_and_si128(_mm_srli_epi16(q, 4), mask))));
    for (int m = 0; m < MT; ++m) {
      const float* xb = x + m * K + bb * QK;
      acc[m][u] = _mm512_fmadd_ps(_mm512_loadu_ps(xb), q0, acc[m][u]);
      acc[m][u + 1] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 16), q1, acc[m][u + 1]);
    }
  };
  for (; b + 2 <= nb; b += 2) {
    block(b, 0);
    block(b + 1, 2);
  }
  if (b < nb) block(b, 0);
  for (int m = 0; m < MT; ++m)
    acc_s[m] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]),
                                                  _mm512_add_ps(acc[m][2], acc[m][3])));
#elif defined(PDC_AVX2)
  __m256 acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    // decode the block once (quants scaled by d), then 4 FMAs per input row
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + b * 16));
    const __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
    const __m256 db = _mm256_broadcast_ss(d + b);
    const __m256 q0 = _mm256_mul_ps(db, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)));
    const __m256 q1 = _mm256_mul_ps(db, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(lo, lo))));
    const __m256 q2 = _mm256_mul_ps(db, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)));
    const __m256 q3 = _mm256_mul_ps(db, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(hi, hi))));
    for (int m = 0; m < MT; ++m) {
      const float* xb = x + m * K + b * QK;
      acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xb), q0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), q1, acc[m][1]);
      acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), q2, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), q3, acc[m][1]);
    }
  }
  for (int m = 0; m < MT; ++m) acc_s[m] = hsum(_mm256_add_ps(acc[m][0], acc[m][1]));
#else
  for (int64_t b = 0; b < nb; ++b)
    for (int m = 0; m < MT; ++m) {
      float t = 0.f;
      for (int j = 0; j < 16; ++j)
        t += x[m * K + b * QK + j] * (qs[b * 16 + j] & 0x0F) + x[m * K + b * QK + 16 + j] * (qs[b * 16 + j] >> 4);
      acc_s[m] += d[b] * t;
    }
#endif
  for (int m = 0; m < MT; ++m) {
    float s = 0.f;
    for (int64_t b = 0; b < nb; ++b) s += mn[b] * xsum[m * nb + b];
    out[m] = acc_s[m] + s;
  }
}

}  // namespace

// y = x @ W.T + bias with W in Q4_1 blocks (see the file comment). x float32 [M, K]; qs uint8
// [N, K/32, 16]; d, m float32 [N, K/32]; bias float32 [N] or None. Returns float32 [M, N].
torch::Tensor linear_q4_1(const torch::Tensor& x_in, const torch::Tensor& qs, const torch::Tensor& d,
                          const torch::Tensor& mn, const c10::optional<torch::Tensor>& bias) {
  check_x("linear_q4_1", x_in);
  const int64_t M = x_in.size(0), K = x_in.size(1);
  TORCH_CHECK(K % QK == 0, "linear_q4_1: K=", K, " must be divisible by 32 (the Q4_1 block size)");
  TORCH_CHECK(qs.device().is_cpu() && qs.scalar_type() == torch::kUInt8 && qs.dim() == 3 && qs.size(1) == K / QK &&
                  qs.size(2) == 16,
              "linear_q4_1: qs must be a CPU uint8 tensor [N, K/32=", K / QK, ", 16], got ", qs.scalar_type(), " ",
              qs.sizes());
  TORCH_CHECK(qs.is_contiguous(), "linear_q4_1: qs must be contiguous");
  const int64_t N = qs.size(0), nb = K / QK;
  for (const auto& [name, t] : {std::pair<const char*, const torch::Tensor&>{"d", d}, {"m", mn}}) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.dim() == 2 && t.size(0) == N &&
                    t.size(1) == nb,
                "linear_q4_1: ", name, " must be a CPU float32 tensor [N=", N, ", K/32=", nb, "], got ",
                t.scalar_type(), " ", t.sizes());
    TORCH_CHECK(t.is_contiguous(), "linear_q4_1: ", name, " must be contiguous");
  }
  check_vec("linear_q4_1", "bias", bias, N);
  const torch::Tensor x = x_in.contiguous();
  const torch::Tensor b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  torch::Tensor y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const torch::Tensor xsum = x.view({M, nb, QK}).sum(2).contiguous();  // [M, K/32]
  const float* xp = x.data_ptr<float>();
  const float* xs = xsum.data_ptr<float>();
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const float* dp = d.data_ptr<float>();
  const float* mp = mn.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, grain_for(nb * 24, 1), [&](int64_t n0, int64_t n1) {
    float out[4];
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* q = qp + n * nb * 16;
      for (int64_t m = 0; m < M;) {
        const int64_t mt = std::min<int64_t>(4, M - m);
        const float* xm = xp + m * K;
        const float* sm = xs + m * nb;
        switch (mt) {
          case 4: row_q4_1<4>(xm, K, sm, q, dp + n * nb, mp + n * nb, out); break;
          case 3: row_q4_1<3>(xm, K, sm, q, dp + n * nb, mp + n * nb, out); break;
          case 2: row_q4_1<2>(xm, K, sm, q, dp + n * nb, mp + n * nb, out); break;
          default: row_q4_1<1>(xm, K, sm, q, dp + n * nb, mp + n * nb, out); break;
        }
        for (int64_t r = 0; r < mt; ++r) yp[(m + r) * N + n] = out[r] + (bp ? bp[n] : 0.f);
        m += mt;
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "weight-only GGUF Q4_1 skinny matmul (AVX2+FMA, dequantized in registers)";
  m.def("linear_q4_1", &linear_q4_1, "y = x @ dequant_q4_1(qs, d, m).T + bias", py::arg("x"), py::arg("qs"),
        py::arg("d"), py::arg("m"), py::arg("bias") = py::none());
}
