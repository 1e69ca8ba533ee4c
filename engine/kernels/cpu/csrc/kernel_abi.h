// How one kernel extension calls another's entry point without Python in between (decode_step.cpp runs a
// decode step's layers by calling the other kernels directly). Each kernel exports its entry point as a
// Python capsule holding the function's address, named after it ("pdcluster.rms_norm"): the mechanism
// CPython documents for sharing a C API between extension modules (PyCapsule; numpy's C API is shared the
// same way). The signatures and capsule names are declared once, here (Entry): a kernel exports through
// abi_capsule(entry, fn), so its entry point must match the declared type or it does not compile, and
// decode_step.cpp imports through the same entry after checking the capsule's name. A change here rebuilds every
// kernel (engine/kernels/cpu/build.py passes a digest of the headers as a flag).
#pragma once

#include "torch_ext.h"

#include <string>

namespace pdc_abi {

// rms_norm(x [R, D], weight [D], eps, offset) -> [R, D] (csrc/rms_norm.cpp)
using RmsNorm = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, double, double);
// add_rms_norm_(x, residual, weight, eps, offset): residual += x, returns its norm (csrc/rms_norm.cpp)
using AddRmsNorm = torch::Tensor (*)(const torch::Tensor&, torch::Tensor&, const torch::Tensor&, double, double);
// rope_store(q, k, v, cos, sin, kv_cache, layer, slot_mapping) (csrc/rope_cache.cpp)
using RopeStore = void (*)(torch::Tensor, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                           const torch::Tensor&, torch::Tensor, int64_t, const torch::Tensor&);
// decode(q, k_cache, v_cache, block_tables, seq_lens, scale, window, heads_per_item) (csrc/paged_attention.cpp)
using PagedDecode = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, double, int64_t, int64_t);
// silu_and_mul(gate_up [T, 2I]) -> [T, I] (csrc/activation.cpp)
using SiluAndMul = torch::Tensor (*)(const torch::Tensor&);
// linear(x, panels, n, bias) (csrc/panel_gemm.cpp)
using PanelLinear = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, int64_t,
                                      const c10::optional<torch::Tensor>&);
// linear_w8a8(x, wpack, spack, excess, n, bias) (csrc/w8a8_gemm.cpp)
using LinearW8A8 = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                     const torch::Tensor&, int64_t, const c10::optional<torch::Tensor>&);
// linear_w4a8(x, wpack, dm, n, bias) (csrc/w4a8_gemm.cpp)
using LinearW4A8 = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, int64_t,
                                     const c10::optional<torch::Tensor>&);

// An entry point: its function type and its capsule's name, declared once below for exporter and importer.
template <class F>
struct Entry {
  using Fn = F;
  const char* name;
};

inline constexpr Entry<RmsNorm> kRmsNorm{"pdcluster.rms_norm"};
inline constexpr Entry<AddRmsNorm> kAddRmsNorm{"pdcluster.add_rms_norm_"};
inline constexpr Entry<RopeStore> kRopeStore{"pdcluster.rope_store"};
inline constexpr Entry<PagedDecode> kPagedDecode{"pdcluster.paged_decode"};
inline constexpr Entry<SiluAndMul> kSiluAndMul{"pdcluster.silu_and_mul"};
inline constexpr Entry<PanelLinear> kPanelLinear{"pdcluster.panel_linear"};
inline constexpr Entry<LinearW8A8> kLinearW8A8{"pdcluster.linear_w8a8"};
inline constexpr Entry<LinearW4A8> kLinearW4A8{"pdcluster.linear_w4a8"};

// `fn` as `entry`'s capsule (fn must convert to the entry's function type, or this does not compile).
template <class F>
py::capsule abi_capsule(const Entry<F>& entry, typename Entry<F>::Fn fn) {
  return py::capsule(reinterpret_cast<void*>(fn), entry.name);
}

// The function `entry`'s capsule holds; a RuntimeError when the capsule is not named as the entry.
template <class F>
F from_capsule(const py::capsule& capsule, const Entry<F>& entry) {
  const char* got = capsule.name();
  TORCH_CHECK(got != nullptr && std::string(got) == entry.name, "expected the kernel capsule '", entry.name,
              "', got '", got == nullptr ? "(unnamed)" : got, "'");
  return reinterpret_cast<F>(capsule.get_pointer());
}

}  // namespace pdc_abi
