// A decode step's decoder layers in one call: the loop of engine/model/decode_plan.py (DecodePlan.__call__)
// run in C++, calling the other kernels' entry points directly (kernel_abi.h), in the same order with the
// same arguments, so the hidden states and the K/V written are bit for bit those of the Python loop.
//
// Why: at batch 1 a decode step is the weight stream plus fixed work per layer. Measured on SmolLM2-135M
// (30 layers) on 2 AVX2 cores, the Python loop's calls (pybind argument conversion, the GIL, tensor views
// made from Python) cost ~2-3 ms of a ~10 ms int8 step: a model with 64-wide layers, whose kernels do almost
// nothing, still took that long per step. Here each layer costs the kernels plus a few tensor views.
//
// DecodeStep(kernels: dict of capsules) is built once per model and KV cache; add_layer(...) binds one
// layer's norms, projections, shapes and cache views; run(x, ropes, kv_cache, slot_mapping, block_tables,
// seq_lens) returns the last layer's output, before the residual add and the model's final norm:
//   x [T, hidden] float32 contiguous, the embedded tokens: the residual stream, updated in place
//   ropes: per RoPE of the model, (cos, sin) of this step's positions, [T, 1, head_dim] float32
//   block_tables [T, max_blocks] int32, seq_lens [T] int32, slot_mapping [T] int64 (as the kernels take them)
// A projection is one of: "f32_panels" (panel_gemm.cpp: panels), "w8a8" (w8a8_gemm.cpp: wpack, spack,
// excess), "w4a8" (w4a8_gemm.cpp: wpack, dm); the gate's activation "silu" (activation.cpp's silu_and_mul),
// "gelu_pytorch_tanh" or "gelu" (ATen's, as F.gelu). Bad arguments raise RuntimeError naming them.
#include "torch_ext.h"
#include "kernel_abi.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <atomic>
#include <iterator>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using Norm = std::tuple<torch::Tensor, double, double>;  // weight, eps, offset
using ProjSpec = std::tuple<std::string, std::vector<torch::Tensor>, int64_t, c10::optional<torch::Tensor>>;

struct Kernels {
  pdc_abi::RmsNorm rms_norm;
  pdc_abi::AddRmsNorm add_rms_norm;
  pdc_abi::RopeStore rope_store;
  pdc_abi::PagedDecode paged_decode;
  pdc_abi::SiluAndMul silu_and_mul;
  pdc_abi::PanelLinear panel_linear;
  pdc_abi::LinearW8A8 linear_w8a8;
  pdc_abi::LinearW4A8 linear_w4a8;
};

enum class ProjKind { F32Panels, W8A8, W4A8 };
enum class Act { Silu, GeluTanh, Gelu };

struct Proj {
  ProjKind kind;
  std::vector<torch::Tensor> w;
  int64_t n;
  c10::optional<torch::Tensor> bias;
};

struct Layer {
  Norm in_norm, post_norm;
  std::vector<Norm> qk_norms, ffn_norms;  // empty, or (q_norm, k_norm) / (pre_feedforward, post_feedforward)
  Proj qkv, o, gate_up, down;
  int64_t q_size, k_size, v_size, num_heads, num_kv_heads, head_dim, window, rope;
  double scale;
  Act act;
  torch::Tensor k_cache, v_cache;
};

template <class F>
F take(const py::dict& kernels, const char* key, const pdc_abi::Entry<F>& entry) {
  TORCH_CHECK(kernels.contains(key), "DecodeStep: no kernel '", key, "' given");
  return pdc_abi::from_capsule(kernels[key].cast<py::capsule>(), entry);
}

// the projection kinds: name, kind, tensors taken
struct KindInfo {
  const char* name;
  ProjKind kind;
  size_t tensors;
};
constexpr KindInfo kKinds[] = {{"f32_panels", ProjKind::F32Panels, 1}, {"w8a8", ProjKind::W8A8, 3},
                               {"w4a8", ProjKind::W4A8, 2}};

Proj make_proj(const ProjSpec& spec) {
  const auto& [kind, w, n, bias] = spec;
  const KindInfo* k =
      std::find_if(std::begin(kKinds), std::end(kKinds), [&](const KindInfo& i) { return kind == i.name; });
  TORCH_CHECK(k != std::end(kKinds), "DecodeStep: unknown projection kind '", kind, "' (f32_panels, w8a8, w4a8)");
  TORCH_CHECK(w.size() == k->tensors, "DecodeStep: a ", kind, " projection takes ", k->tensors, " tensors, got ",
              w.size());
  return Proj{k->kind, w, n, bias};
}

Act make_act(const std::string& name) {
  if (name == "silu") return Act::Silu;
  if (name == "gelu_pytorch_tanh") return Act::GeluTanh;
  TORCH_CHECK(name == "gelu", "DecodeStep: unknown activation '", name, "' (silu, gelu_pytorch_tanh, gelu)");
  return Act::Gelu;
}

class DecodeStep {
 public:
  explicit DecodeStep(const py::dict& kernels)
      : k_{take(kernels, "rms_norm", pdc_abi::kRmsNorm),
           take(kernels, "add_rms_norm_", pdc_abi::kAddRmsNorm),
           take(kernels, "rope_store", pdc_abi::kRopeStore),
           take(kernels, "paged_decode", pdc_abi::kPagedDecode),
           take(kernels, "silu_and_mul", pdc_abi::kSiluAndMul),
           take(kernels, "panel_linear", pdc_abi::kPanelLinear),
           take(kernels, "linear_w8a8", pdc_abi::kLinearW8A8),
           take(kernels, "linear_w4a8", pdc_abi::kLinearW4A8)} {}

  // projs: qkv, o, gate_up, down; dims: q_size, k_size, v_size, num_heads, num_kv_heads, head_dim, window
  // (0: the whole context), rope (which of run()'s ropes the layer takes).
  void add_layer(const Norm& in_norm, const Norm& post_norm, const std::vector<Norm>& qk_norms,
                 const std::vector<Norm>& ffn_norms, const std::vector<ProjSpec>& projs,
                 const std::vector<int64_t>& dims, double scale, const std::string& act, torch::Tensor k_cache,
                 torch::Tensor v_cache) {
    // run() goes without the GIL: a layer added while a step runs would move the layers under it
    TORCH_CHECK(!ran_.load(), "DecodeStep.add_layer: layers are added before the first run()");
    TORCH_CHECK(projs.size() == 4, "DecodeStep.add_layer: projs must be (qkv, o, gate_up, down), got ",
                projs.size());
    TORCH_CHECK(dims.size() == 8, "DecodeStep.add_layer: dims must hold 8 numbers, got ", dims.size());
    TORCH_CHECK(qk_norms.empty() || qk_norms.size() == 2, "DecodeStep.add_layer: qk_norms must be () or 2 norms");
    TORCH_CHECK(ffn_norms.empty() || ffn_norms.size() == 2, "DecodeStep.add_layer: ffn_norms must be () or 2 norms");
    layers_.push_back(Layer{in_norm, post_norm, qk_norms, ffn_norms, make_proj(projs[0]), make_proj(projs[1]),
                            make_proj(projs[2]), make_proj(projs[3]), dims[0], dims[1], dims[2], dims[3], dims[4],
                            dims[5], dims[6], dims[7], scale, make_act(act), std::move(k_cache),
                            std::move(v_cache)});
  }

  torch::Tensor run(const torch::Tensor& x, const std::vector<std::pair<torch::Tensor, torch::Tensor>>& ropes,
                    const torch::Tensor& kv_cache, const torch::Tensor& slots, const torch::Tensor& tables,
                    const torch::Tensor& lens) const {
    TORCH_CHECK(!layers_.empty(), "DecodeStep.run: no layers added");
    ran_.store(true);
    TORCH_CHECK(x.dim() == 2, "DecodeStep.run: x must be [T, hidden], got ", x.sizes());
    const int64_t t = x.size(0);
    torch::Tensor residual = x, out;  // x itself: each layer adds into it, as DecodePlan's loop
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& c = layers_[i];
      TORCH_CHECK(c.rope >= 0 && c.rope < static_cast<int64_t>(ropes.size()), "DecodeStep.run: layer ", i,
                  " takes rope ", c.rope, ", ", ropes.size(), " given");
      torch::Tensor h = out.defined() ? add_norm(out, residual, c.in_norm) : norm(x.contiguous(), c.in_norm);
      const torch::Tensor qkv = linear(c.qkv, h);
      torch::Tensor q = qkv.narrow(1, 0, c.q_size), k = qkv.narrow(1, c.q_size, c.k_size);
      torch::Tensor v = qkv.narrow(1, c.q_size + c.k_size, c.v_size);
      if (t > 1) {  // one row's parts are contiguous already
        q = q.contiguous(), k = k.contiguous(), v = v.contiguous();
      }
      q = q.view({t, c.num_heads, c.head_dim});
      k = k.view({t, c.num_kv_heads, c.head_dim});
      if (!c.qk_norms.empty()) q = norm(q, c.qk_norms[0]), k = norm(k, c.qk_norms[1]);
      {
        RECORD_FUNCTION("pdcluster::rope_store", std::vector<c10::IValue>());
        k_.rope_store(q, k, v.view({t, c.num_kv_heads, c.head_dim}), ropes[c.rope].first, ropes[c.rope].second,
                      kv_cache, static_cast<int64_t>(i), slots);
      }
      torch::Tensor a;
      {
        RECORD_FUNCTION("pdcluster::paged_decode_attention", std::vector<c10::IValue>());
        a = k_.paged_decode(q, c.k_cache, c.v_cache, tables, lens, c.scale, c.window, 1);
      }
      out = linear(c.o, a.reshape({t, c.num_heads * c.head_dim}));
      h = c.ffn_norms.empty() ? add_norm(out, residual, c.post_norm)
                              : add_norm(norm(out, c.post_norm), residual, c.ffn_norms[0]);
      out = linear(c.down, activation(c.act, linear(c.gate_up, h)));
      if (!c.ffn_norms.empty()) out = norm(out, c.ffn_norms[1]);
    }
    return out;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  torch::Tensor norm(const torch::Tensor& x, const Norm& n) const {
    RECORD_FUNCTION("pdcluster::rms_norm", std::vector<c10::IValue>());
    return k_.rms_norm(x, std::get<0>(n), std::get<1>(n), std::get<2>(n));
  }

  torch::Tensor add_norm(const torch::Tensor& x, torch::Tensor& residual, const Norm& n) const {
    RECORD_FUNCTION("pdcluster::add_rms_norm", std::vector<c10::IValue>());
    return k_.add_rms_norm(x, residual, std::get<0>(n), std::get<1>(n), std::get<2>(n));
  }

  torch::Tensor linear(const Proj& p, const torch::Tensor& x) const {
    switch (p.kind) {
      case ProjKind::F32Panels: {
        RECORD_FUNCTION("pdcluster::panel_gemm", std::vector<c10::IValue>());
        return k_.panel_linear(x, p.w[0], p.n, p.bias);
      }
      case ProjKind::W8A8: {
        RECORD_FUNCTION("pdcluster::linear_w8a8", std::vector<c10::IValue>());
        return k_.linear_w8a8(x, p.w[0], p.w[1], p.w[2], p.n, p.bias);
      }
      default: {
        RECORD_FUNCTION("pdcluster::linear_w4a8", std::vector<c10::IValue>());
        return k_.linear_w4a8(x, p.w[0], p.w[1], p.n, p.bias);
      }
    }
  }

  // act(gate) * up over gate_up's halves, as MLP.forward (and DecodePlan) compute it
  torch::Tensor activation(Act act, const torch::Tensor& gate_up) const {
    if (act == Act::Silu) {
      RECORD_FUNCTION("pdcluster::silu_and_mul", std::vector<c10::IValue>());
      return k_.silu_and_mul(gate_up);
    }
    const auto halves = gate_up.chunk(2, -1);
    return at::mul(at::gelu(halves[0], act == Act::GeluTanh ? "tanh" : "none"), halves[1]);
  }

  Kernels k_;
  std::vector<Layer> layers_;
  mutable std::atomic<bool> ran_{false};
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<DecodeStep>(m, "DecodeStep", "A decode step's decoder layers in one call (see the source's comment)")
      .def(py::init<const py::dict&>(), py::arg("kernels"))
      .def("add_layer", &DecodeStep::add_layer, py::arg("in_norm"), py::arg("post_norm"), py::arg("qk_norms"),
           py::arg("ffn_norms"), py::arg("projs"), py::arg("dims"), py::arg("scale"), py::arg("act"),
           py::arg("k_cache"), py::arg("v_cache"))
      .def("run", &DecodeStep::run, py::arg("x"), py::arg("ropes"), py::arg("kv_cache"),
           py::arg("slot_mapping"), py::arg("block_tables"), py::arg("seq_lens"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("num_layers", &DecodeStep::num_layers);
}
