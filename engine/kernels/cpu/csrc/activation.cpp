// A gated MLP's activation in one call: silu_and_mul(gate_up [T, 2I]) -> silu(gate_up[:, :I]) * gate_up[:, I:]
// (vLLM's silu_and_mul: the merged gate/up projection's output in, the down projection's input out).
// The result is bit for bit what `F.silu(gate) * up` gives. Contiguous float32 rows are computed here with
// ATen's own formula and exp, in the vector width ATen's dispatch chose on this machine
// (torch.backends.cpu.get_cpu_capability()): its CPU silu kernel computes x / (1 + exp(-x)) two vectors at a
// time, exp by SLEEF (Sleef_expf8_u10 for AVX2, Sleef_expf16_u10 for AVX-512), and the elements left over
// (fewer than two vectors) by its scalar loop through std::exp; then one rounding multiply by up. The rows are
// split over threads as ATen splits the elements, so the same elements reach the scalar loop at any thread
// count. Anything else (another dtype, a strided view, a capability this build lacks, a torch whose kernel
// gives other bits on a probe at first use) runs torch's silu and mul operators from C++. Why not always
// those: two operators cost ~10-20 us of allocation and TensorIterator set-up per call on 2 AVX2 cores, against
// ~1 us of work on a batch-1 decode step's 1536 floats (SmolLM2: 30 calls a step).
#include "torch_ext.h"
#include "kernel_abi.h"

#include <ATen/TensorIterator.h>
#include <ATen/Version.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "simd.h"
#ifdef PDC_AVX2
#include <sleef.h>
#endif

namespace {

enum class Lanes { None, Avx2, Avx512 };

// out[j] = silu(gate[j]) * up[j] for j < n, rounded as torch's silu then mul (see the file comment); a row or
// the piece of one that a task of ATen's split holds
inline void silu_mul_row(Lanes lanes, const float* gate, const float* up, float* out, int64_t n) {
  int64_t j = 0;
#ifdef PDC_AVX512
  if (lanes == Lanes::Avx512)
    for (; j + 32 <= n; j += 32)
      for (int64_t v = j; v < j + 32; v += 16) {
        const __m512 x = _mm512_loadu_ps(gate + v);
        const __m512 neg = _mm512_castsi512_ps(  // -x by its sign bit, as ATen's neg()
            _mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(static_cast<int>(0x80000000u))));
        const __m512 e = Sleef_expf16_u10(neg);
        const __m512 s = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e));
        _mm512_storeu_ps(out + v, _mm512_mul_ps(s, _mm512_loadu_ps(up + v)));
      }
#endif
#ifdef PDC_AVX2
  if (lanes == Lanes::Avx2) {
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    for (; j + 16 <= n; j += 16)
      for (int64_t v = j; v < j + 16; v += 8) {
        const __m256 x = _mm256_loadu_ps(gate + v);
        const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, Sleef_expf8_u10(_mm256_xor_ps(x, sign))));
        _mm256_storeu_ps(out + v, _mm256_mul_ps(s, _mm256_loadu_ps(up + v)));
      }
  }
#endif
  for (; j < n; ++j) {
    const float s = gate[j] / (1.f + std::exp(-gate[j]));
    out[j] = s * up[j];
  }
}

// Whether silu_mul_row with `lanes` gives ATen's bits on probe rows (lengths with and without elements left
// for the scalar loop, at both vector widths): a torch whose silu kernel took another width or formula than the
// one this file follows would fail here, and the kernel then runs ATen's operators instead.
bool agrees_with_aten(Lanes lanes) {
  for (const int64_t half : {53, 80}) {
    const torch::Tensor x = at::sin(at::arange(2 * half, at::kFloat) * 0.37) * 9.0;
    const torch::Tensor want = at::mul(at::silu(x.narrow(0, 0, half)), x.narrow(0, half, half));
    torch::Tensor got = torch::empty({half}, x.options());
    const float* xp = x.data_ptr<float>();
    silu_mul_row(lanes, xp, xp + half, got.data_ptr<float>(), half);
    if (!at::equal(got, want)) return false;
  }
  return true;
}

// The vector width of ATen's CPU kernels here, where this build has it too and agrees with ATen (else None:
// ATen's operators run)
Lanes aten_lanes() {
  static const Lanes lanes = [] {
    const std::string cap = at::get_cpu_capability();
    Lanes l = Lanes::None;
#ifdef PDC_AVX512
    if (cap == "AVX512") l = Lanes::Avx512;
#endif
#ifdef PDC_AVX2
    if (cap == "AVX2") l = Lanes::Avx2;
#endif
    return l != Lanes::None && agrees_with_aten(l) ? l : Lanes::None;
  }();
  return lanes;
}

}  // namespace

torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "gate_up must be [..., 2 * intermediate] (an even last dimension), got ", gate_up.sizes());
  const int64_t half = gate_up.size(-1) / 2;
  const Lanes lanes = aten_lanes();
  if (lanes == Lanes::None || gate_up.scalar_type() != torch::kFloat32 || !gate_up.device().is_cpu() ||
      !gate_up.is_contiguous())
    return at::mul(at::silu(gate_up.narrow(-1, 0, half)), gate_up.narrow(-1, half, half));
  auto sizes = gate_up.sizes().vec();
  sizes.back() = half;
  torch::Tensor out = torch::empty(sizes, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // the output's elements split over threads as ATen's TensorIterator splits them (at::internal::GRAIN_SIZE per
  // task at least): a task may start or end inside a row, and ATen's vector loop then starts at the task's
  // first element of that row, so the elements left to its scalar loop are the same here
  at::parallel_for(0, out.numel(), at::internal::GRAIN_SIZE, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end;) {
      const int64_t r = i / half, j = i - r * half, n = std::min(half - j, end - i);
      silu_mul_row(lanes, in + r * 2 * half + j, in + r * 2 * half + half + j, op + i, n);
      i += n;
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("silu_and_mul_abi") =  // decode_step.cpp
      pdc_abi::abi_capsule(pdc_abi::kSiluAndMul, &silu_and_mul);
  m.def("silu_and_mul", &silu_and_mul, "silu(gate_up[..., :I]) * gate_up[..., I:]", py::arg("gate_up"),
        py::call_guard<py::gil_scoped_release>());
}
