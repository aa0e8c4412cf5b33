// A decoder's layers for a step of few rows (decodes, speculative verification, short chunks) in one call.
//
// Why: each layer of models/llama.py's forward is a dozen operator calls, and from Python each pays for the
// dispatch in kernels/*.py, argument conversion and the tensors' wrappers, which for one token of a small model is
// as long as the operator's own work (perf/RESULTS.md, "the decode stack"). Here the layers call the same
// operators in the same order, on the same dtypes and with the same conversions as the Python path, so they give
// the same hidden states to the bit; only the Python between the calls goes. models/decode_stack.py decides which
// models and steps take this path and builds the stack from a loaded model.
#include "decode_layers.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include "operators.h"

#include <chrono>

namespace trellm {

namespace {

// The parts a timed forward splits its time into.
enum Part { kQkv, kAttention, kO, kGateUp, kDown, kOther };
constexpr const char* kPartNames[] = {"qkv", "attention", "o", "gate_up", "down", "norms and activation"};

// Adds the time since the last lap to a part, when timing is on.
class Laps {
 public:
  Laps(bool on, std::array<double, 6>& seconds) : on_(on), seconds_(seconds), last_(now()) {}
  void to(Part part) {
    if (!on_) return;
    const auto t = now();
    seconds_[part] += std::chrono::duration<double>(t - last_).count();
    last_ = t;
  }

 private:
  static std::chrono::steady_clock::time_point now() { return std::chrono::steady_clock::now(); }
  bool on_;
  std::array<double, 6>& seconds_;
  std::chrono::steady_clock::time_point last_;
};

bool is_quantized_cache(const at::Tensor& cache) {
  return cache.scalar_type() == at::kChar || cache.scalar_type() == at::kFloat8_e4m3fn;
}

// torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], ""), what kernels/linear.py calls on a prepacked
// weight; through the dispatcher's boxed call, which does not depend on how this torch types the schema's strings.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, w, bias.has_value() ? c10::IValue(*bias) : c10::IValue(), c10::IValue(std::string("none")),
                          c10::IValue(c10::List<c10::optional<at::Scalar>>()), c10::IValue(std::string())};
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

}  // namespace

DecodeLayers::DecodeLayers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                           double softcap, bool gelu, int64_t max_q_len)
    : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
      softcap_(softcap), gelu_(gelu), max_q_len_(max_q_len) {}

void DecodeLayers::add_layer(at::Tensor input_norm, at::Tensor post_norm, c10::optional<at::Tensor> q_norm,
                             c10::optional<at::Tensor> k_norm, c10::optional<at::Tensor> attn_out_norm,
                             c10::optional<at::Tensor> mlp_out_norm, at::Tensor cos_sin, int64_t window) {
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat, "DecodeLayers: the rotary table must be float32");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "DecodeLayers: q and k norms come together");
  StackLayer layer;
  layer.input_norm = input_norm.contiguous();
  layer.post_norm = post_norm.contiguous();
  layer.q_norm = q_norm;
  layer.k_norm = k_norm;
  layer.attn_out_norm = attn_out_norm;
  layer.mlp_out_norm = mlp_out_norm;
  layer.cos_sin = cos_sin.contiguous();
  layer.window = window;
  layers_.push_back(std::move(layer));
}

void DecodeLayers::add_linear(int64_t kind, at::Tensor weight, c10::optional<at::Tensor> scales,
                              c10::optional<at::Tensor> bias, int64_t group) {
  TORCH_CHECK(!layers_.empty() && layers_.back().linears.size() < 4, "DecodeLayers: four linears per layer");
  TORCH_CHECK(kind >= 0 && kind <= static_cast<int64_t>(LinearKind::kOneDnn), "DecodeLayers: unknown kind ", kind);
  StackLinear w;
  w.kind = static_cast<LinearKind>(kind);
  w.weight = weight;
  w.group = group;
  if (w.kind == LinearKind::kInt8 || w.kind == LinearKind::kGroup) {
    TORCH_CHECK(scales.has_value(), "DecodeLayers: an int8 or group weight needs its scales");
    // int8_linear takes float32 scales (kernels/linear.py widens other dtypes for each call)
    w.scales = w.kind == LinearKind::kInt8 ? scales->to(at::kFloat).contiguous() : *scales;
  }
  if (bias.has_value()) {
    w.bias = *bias;
    w.bias_f32 = bias->to(at::kFloat).contiguous();
  }
  // Blocked layouts [out/B, in, B] and k-pairs [out/B, in/2, B, 2] both keep B outputs per block in dim 2.
  w.out_features = w.kind == LinearKind::kTorch || w.kind == LinearKind::kOneDnn ? 0 : weight.size(0) * weight.size(2);
  layers_.back().linears.push_back(std::move(w));
}

// kernels/linear.py's linear for one held weight. Torch's and oneDNN's take x as it is. For the C++ operators
// (packed_linear, int8_linear, group_linear) x is converted to the operator's dtype, and the result comes in float32
// (with the bias where the Python path adds it), rounded back to x's dtype.
at::Tensor DecodeLayers::linear(const StackLinear& w, const at::Tensor& x) const {
  if (w.kind == LinearKind::kTorch) return at::linear(x, w.weight, w.bias);
  if (w.kind == LinearKind::kOneDnn) return onednn_linear(x, w.weight, w.bias);
  const auto in_dtype = w.kind == LinearKind::kBf16Pairs ? at::kBFloat16 : at::kFloat;
  const at::Tensor x2 = x.to(in_dtype).contiguous();
  at::Tensor y = at::empty({x2.size(0), w.out_features}, x2.options().dtype(at::kFloat));
  switch (w.kind) {
    case LinearKind::kFp32Packed: fp32_linear_cpu(y, x2, w.weight, w.bias_f32); break;
    case LinearKind::kHalfPacked: half_linear_cpu(y, x2, w.weight, w.bias_f32); break;
    case LinearKind::kBf16Pairs: bf16_linear_cpu(y, x2, w.weight, w.bias_f32); break;
    case LinearKind::kInt8: int8_linear_cpu(y, x2, w.weight, w.scales); break;
    case LinearKind::kGroup: group_linear_cpu(y, x2, w.weight, w.scales, w.group); break;
    default: break;
  }
  // int8_linear and group_linear take no bias: the Python path adds it to their float32 result
  if ((w.kind == LinearKind::kInt8 || w.kind == LinearKind::kGroup) && w.bias.has_value()) y.add_(*w.bias);
  return y.to(x.scalar_type());
}

// kernels/rmsnorm.py's rms_norm of contiguous rows.
at::Tensor DecodeLayers::norm(const at::Tensor& x, const at::Tensor& weight) const {
  at::Tensor out = at::empty_like(x);
  rms_norm_cpu(out, x, weight, eps_);
  return out;
}

// kernels/rmsnorm.py's fused_add_rms_norm: (rms_norm(h + residual), h + residual).
std::tuple<at::Tensor, at::Tensor> DecodeLayers::add_norm(const at::Tensor& h, const at::Tensor& residual,
                                                          const at::Tensor& weight) const {
  at::Tensor out = at::empty_like(h), res_out = at::empty_like(residual);
  fused_add_rms_norm_cpu(out, res_out, h, residual, weight, eps_);
  return {out, res_out};
}

std::tuple<at::Tensor, at::Tensor> DecodeLayers::forward(at::Tensor h, at::Tensor positions, at::Tensor slot_mapping,
                                                         at::Tensor cu_seqlens_q, at::Tensor seq_lens,
                                                         at::Tensor block_tables, at::Tensor kv_cache,
                                                         c10::optional<at::Tensor> kv_scales,
                                                         int64_t max_q_len) const {
  TORCH_CHECK(max_q_len <= max_q_len_, "DecodeLayers: rows of at most ", max_q_len_, " tokens a sequence");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.size(0) == static_cast<int64_t>(layers_.size()) &&
                  kv_cache.size(1) == 2, "DecodeLayers: a contiguous KV cache [layers, 2, ...] of this model");
  TORCH_CHECK(!is_quantized_cache(kv_cache) || (kv_scales.has_value() && kv_scales->is_contiguous()),
              "DecodeLayers: an INT8 or FP8 KV cache needs its contiguous scales");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && (layers_.empty() ||
                  h.scalar_type() == layers_[0].input_norm.scalar_type()),
              "DecodeLayers: h must be contiguous [T, hidden] rows in the model's dtype");
  for (const auto& layer : layers_)
    TORCH_CHECK(layer.linears.size() == 4, "DecodeLayers: a layer has ", layer.linears.size(), " linears, not 4");
  const int64_t T = h.size(0), H = num_heads_, KVH = num_kv_heads_, D = head_dim_;
  const int64_t q_size = H * D, kv_size = KVH * D;
  const at::Tensor pos = positions.to(at::kInt), slots = slot_mapping.to(at::kInt);
  const at::Tensor cu = cu_seqlens_q.to(at::kInt), lens = seq_lens.to(at::kInt);
  const at::Tensor tables = block_tables.to(at::kInt).contiguous();
  at::Tensor residual;
  Laps laps(timed_, seconds_);
  for (size_t i = 0; i < layers_.size(); ++i) {
    const StackLayer& layer = layers_[i];
    at::Tensor x;
    if (i == 0) {
      residual = h;
      x = norm(h, layer.input_norm);
    } else {
      std::tie(x, residual) = add_norm(h, residual, layer.input_norm);
    }
    laps.to(kOther);
    const at::Tensor qkv = linear(layer.linears[0], x);
    laps.to(kQkv);
    at::Tensor q = qkv.narrow(1, 0, q_size).reshape({T, H, D}).contiguous();
    at::Tensor k = qkv.narrow(1, q_size, kv_size).reshape({T, KVH, D}).contiguous();
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).reshape({T, KVH, D});
    if (layer.q_norm.has_value()) {
      q = norm(q, *layer.q_norm);
      k = norm(k, *layer.k_norm);
    }
    rotary_cpu(q, k, pos, layer.cos_sin);
    const at::Tensor k_cache = kv_cache.select(0, i).select(0, 0), v_cache = kv_cache.select(0, i).select(0, 1);
    at::Tensor attn = at::empty_like(q);
    if (is_quantized_cache(k_cache)) {
      const bool is_int8 = k_cache.scalar_type() == at::kChar;
      const at::Tensor k_scale = kv_scales->select(0, i).select(0, 0), v_scale = kv_scales->select(0, i).select(0, 1);
      const at::Tensor k_bytes = k_cache.view(at::kChar), v_bytes = v_cache.view(at::kChar);
      write_kv_quantized_cpu(k, v, k_bytes, v_bytes, k_scale, v_scale, slots, is_int8);
      paged_attention_quantized_cpu(attn, q, k_bytes, v_bytes, k_scale, v_scale, cu, lens, tables, scale_,
                                    max_q_len_, is_int8, layer.window, softcap_);
    } else {
      write_kv_cpu(k, v, k_cache, v_cache, slots);
      paged_attention_cpu(attn, q, k_cache, v_cache, cu, lens, tables, scale_, max_q_len_, layer.window,
                          softcap_);
    }
    laps.to(kAttention);
    h = linear(layer.linears[1], attn.reshape({T, q_size}));
    laps.to(kO);
    if (layer.attn_out_norm.has_value()) h = norm(h, *layer.attn_out_norm);
    std::tie(x, residual) = add_norm(h, residual, layer.post_norm);
    laps.to(kOther);
    const at::Tensor gate_up = linear(layer.linears[2], x);
    laps.to(kGateUp);
    at::Tensor act;
    if (gelu_) {   // kernels/activation.py's gelu_tanh_and_mul_reference, op for op
      const auto halves = gate_up.chunk(2, -1);
      act = at::gelu(halves[0], "tanh") * halves[1];
    } else {
      act = at::empty({T, gate_up.size(1) / 2}, gate_up.options());
      silu_and_mul_cpu(act, gate_up);
    }
    laps.to(kOther);
    h = linear(layer.linears[3], act);
    laps.to(kDown);
    if (layer.mlp_out_norm.has_value()) h = norm(h, *layer.mlp_out_norm);
  }
  laps.to(kOther);
  return {h, residual};
}

std::map<std::string, double> DecodeLayers::seconds() {
  std::map<std::string, double> out;
  for (size_t i = 0; i < seconds_.size(); ++i) out[kPartNames[i]] = seconds_[i];
  seconds_.fill(0.0);
  return out;
}

}  // namespace trellm
