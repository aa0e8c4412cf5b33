// The CPU operators' entry points, for the Python module (bindings.cpp) and for the operators that call others
// (decode_layers.cpp). Each is defined in the file of its kind.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

void paged_attention_cpu(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                         at::Tensor cu_seqlens_q, at::Tensor seq_lens, at::Tensor block_tables,
                         double scale, int64_t max_q_len, int64_t window, double softcap);
void paged_attention_quantized_cpu(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                   at::Tensor k_scale, at::Tensor v_scale, at::Tensor cu_seqlens_q,
                                   at::Tensor seq_lens, at::Tensor block_tables, double scale, int64_t max_q_len,
                                   bool is_int8, int64_t window, double softcap);
void rms_norm_cpu(at::Tensor out, at::Tensor x, at::Tensor weight, double eps);
void fused_add_rms_norm_cpu(at::Tensor out, at::Tensor res_out, at::Tensor x, at::Tensor residual,
                            at::Tensor weight, double eps);
void rotary_cpu(at::Tensor q, at::Tensor k, at::Tensor positions, at::Tensor cos_sin);
void silu_and_mul_cpu(at::Tensor out, at::Tensor x);
void int8_linear_cpu(at::Tensor y, at::Tensor x, at::Tensor packed, at::Tensor scales);
void group_linear_cpu(at::Tensor y, at::Tensor x, at::Tensor packed, at::Tensor scales, int64_t group);
void quantize_rows_int8_cpu(at::Tensor q, at::Tensor scales, at::Tensor x);
void fp32_linear_cpu(at::Tensor y, at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias);
void half_linear_cpu(at::Tensor y, at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias);
void bf16_linear_cpu(at::Tensor y, at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias);
void bf16_amx_linear_cpu(at::Tensor y, at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias);
bool bf16_amx_ready();
void write_kv_cpu(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
                  at::Tensor slot_mapping);
void gather_dequantize_cpu(at::Tensor out, at::Tensor cache, at::Tensor scales, at::Tensor blocks,
                           bool is_int8);
void lora_add_cpu(at::Tensor out, at::Tensor x, at::Tensor a_t, at::Tensor b_t, at::Tensor spans,
                  double scale);
void write_kv_quantized_cpu(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor k_scale, at::Tensor v_scale, at::Tensor slot_mapping, bool is_int8);
