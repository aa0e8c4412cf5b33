// A decoder's layers run for a step of few rows in one call from Python (decode_layers.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <array>
#include <map>
#include <string>
#include <tuple>
#include <vector>

namespace trellm {

// How a linear layer's weight is held, i.e. which operator multiplies by it (kernels/linear.py's names).
enum class LinearKind : int64_t {
  kFp32Packed = 0,   // fp32_linear: float32 blocks
  kHalfPacked = 1,   // half_linear: bf16/fp16 blocks, float32 activations
  kBf16Pairs = 2,    // bf16_linear: bf16 k-pairs, bf16 activations
  kInt8 = 3,         // int8_linear: int8 blocks and a scale per output, float32 activations
  kGroup = 4,        // group_linear: integers with a scale (and a minimum) per group, float32 activations
  kTorch = 5,        // torch's linear on the dense weight, in the activations' dtype
  kOneDnn = 6,       // oneDNN's linear on its prepacked weight (mkldnn::_linear_pointwise)
};

struct StackLinear {
  LinearKind kind;
  at::Tensor weight;                  // the packed weight the operator reads
  at::Tensor scales;                  // kInt8, kGroup: the scales (undefined otherwise)
  c10::optional<at::Tensor> bias;     // in the activations' dtype
  c10::optional<at::Tensor> bias_f32; // the bias as the blocked operators take it
  int64_t group = 0;                  // kGroup: inputs per group
  int64_t out_features = 0;
};

struct StackLayer {
  at::Tensor input_norm, post_norm;
  c10::optional<at::Tensor> q_norm, k_norm;               // Qwen3, Gemma 3: each head normed before rotary
  c10::optional<at::Tensor> attn_out_norm, mlp_out_norm;  // Gemma: each block's output normed before the add
  at::Tensor cos_sin;                 // the layer's rope table, float32
  std::vector<StackLinear> linears;   // qkv, o, gate_up, down
  int64_t window = 0;                 // sliding window of the attention; 0: full
};

class DecodeLayers {
 public:
  // gelu: the MLP's activation is GELU's tanh approximation (Gemma), else SiLU; softcap > 0: attention scores
  // capped by tanh (Gemma 2); max_q_len: the longest row of a sequence the C++ attention takes (longer ones are
  // kernels/attention.py's to finish, so the stack refuses them).
  DecodeLayers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale, double softcap,
               bool gelu, int64_t max_q_len);
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, c10::optional<at::Tensor> q_norm,
                 c10::optional<at::Tensor> k_norm, c10::optional<at::Tensor> attn_out_norm,
                 c10::optional<at::Tensor> mlp_out_norm, at::Tensor cos_sin, int64_t window);
  // Appends a linear to the last layer added: qkv, o, gate_up, down in that order.
  void add_linear(int64_t kind, at::Tensor weight, c10::optional<at::Tensor> scales, c10::optional<at::Tensor> bias,
                  int64_t group);
  // h [T, hidden] (the embeddings) -> (h, residual) after the last layer, as models/llama.py's loop leaves them.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor h, at::Tensor positions, at::Tensor slot_mapping,
                                             at::Tensor cu_seqlens_q, at::Tensor seq_lens, at::Tensor block_tables,
                                             at::Tensor kv_cache, c10::optional<at::Tensor> kv_scales,
                                             int64_t max_q_len) const;
  // With timing on, forward adds each part's seconds to `seconds()` (read and reset by seconds()), so a profile
  // can split a step the Python side does not see into.
  void set_timed(bool timed) { timed_ = timed; }
  std::map<std::string, double> seconds();

 private:
  at::Tensor linear(const StackLinear& w, const at::Tensor& x) const;
  at::Tensor norm(const at::Tensor& x, const at::Tensor& weight) const;
  std::tuple<at::Tensor, at::Tensor> add_norm(const at::Tensor& h, const at::Tensor& residual,
                                              const at::Tensor& weight) const;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_, softcap_;
  bool gelu_;
  int64_t max_q_len_;
  bool timed_ = false;
  mutable std::array<double, 6> seconds_{};   // per Part (decode_layers.cpp)
  std::vector<StackLayer> layers_;
};

}  // namespace trellm
