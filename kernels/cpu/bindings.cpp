// The Python module of the CPU operators (kernels/cpu_ops.py builds it). Every operator runs without the GIL:
// the server's responder thread builds and sends responses meanwhile.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "blocked_linear.h"
#include "decode_layers.h"
#include "operators.h"
#include "vec_math.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_attention", &paged_attention_cpu,
        "Paged attention over a mixed batch of prefill chunks and decodes, reading the cache in place (window > 0: "
        "each row sees its last `window` keys; softcap > 0: scores capped by tanh)", no_gil);
  m.def("paged_attention_quantized", &paged_attention_quantized_cpu,
        "paged_attention over an INT8 or FP8 e4m3 cache (int8 views) with per-token-and-head float16 scales", no_gil);
  m.def("rms_norm", &rms_norm_cpu, "out = rms_norm(x) * weight", no_gil);
  m.def("fused_add_rms_norm", &fused_add_rms_norm_cpu, "res_out = x + residual; out = rms_norm(res_out) * weight",
        no_gil);
  m.def("rotary", &rotary_cpu, "in place rotate-half rotary embedding of q and k", no_gil);
  m.def("silu_and_mul", &silu_and_mul_cpu, "out = silu(gate) * up", no_gil);
  m.def("int8_linear", &int8_linear_cpu, "y = x (q * scales)^T with q int8 packed [N/32, K, 32]", no_gil);
  m.def("group_linear", &group_linear_cpu,
        "y = x (q * scales - mins)^T with q int8 packed [N/32, K, 32] or 4-bit packed two inputs a byte "
        "[N/32, K/2, 32], a scale (and a minimum) per output and group of 16, 32, 64 or 128 inputs packed "
        "[N/32, K/group, 1 or 2, 32]", no_gil);
  m.def("quantize_rows_int8", &quantize_rows_int8_cpu,
        "q[m] = x[m] rounded to int8 with scales[m] = max |x[m]| / 127 (W8A8 activations)", no_gil);
  m.def("fp32_linear", &fp32_linear_cpu, "y = x w^T (+ bias) with w float32 packed [N/32, K, 32] (AVX-512 builds)",
        py::arg("y"), py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(), no_gil);
  m.def("half_linear", &half_linear_cpu,
        "y = x w^T (+ bias) with w bf16 or fp16 packed [N/32, K, 32], x, y and bias float32 (AVX2 builds)",
        py::arg("y"), py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(), no_gil);
  m.def("bf16_linear", &bf16_linear_cpu,
        "y = x w^T (+ bias) with x bf16, w bf16 packed in k-pairs [N/32, K/2, 32, 2], y and bias float32 "
        "(AVX512-BF16 builds)", py::arg("y"), py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(), no_gil);
  m.def("bf16_amx_linear", &bf16_amx_linear_cpu,
        "bf16_linear's y (float32, or bf16 rounded once) on AMX tiles; K a multiple of 32 (AMX-BF16 builds)",
        py::arg("y"), py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(), no_gil);
  // Whether bf16_amx_linear runs in this process: an AMX-BF16 build, and Linux granted the tile state.
  m.def("bf16_amx_ready", &bf16_amx_ready);
  m.def("write_kv", &write_kv_cpu, "store k and v at their slots of the paged caches", no_gil);
  m.def("gather_dequantize", &gather_dequantize_cpu,
        "out[i] = the INT8 / FP8 cache block blocks[i], each value times its token-and-head scale", no_gil);
  m.attr("linear_block") = trellm::blocked_linear::BLOCK;   // outputs per packed block (kernels/linear.py checks)
  // Which tiles the build took (-march=native): the linear dispatch (kernels/linear.py) reads it.
#if defined(__AVX512F__)
  m.attr("avx512") = true;
#else
  m.attr("avx512") = false;
#endif
#if defined(__AVX512BF16__)   // bf16 pair dot products: the bf16 operator
  m.attr("avx512_bf16") = true;
#else
  m.attr("avx512_bf16") = false;
#endif
#if defined(TRELLM_AVX2)   // AVX2 without AVX-512 (vec_math.h)
  m.attr("avx2") = true;
#else
  m.attr("avx2") = false;
#endif
  m.def("lora_add", &lora_add_cpu,
        "out += scale * (x at) bt for one adapter's rows, bt block-diagonal with each rank row's column span",
        no_gil);
  m.def("write_kv_quantized", &write_kv_quantized_cpu,
        "quantize k and v per token and head into an INT8 or FP8 cache (int8 views) and its float16 scales", no_gil);
  // module_local: each instruction-set build of this module (cpu_ops.load_isa) binds its own class of this name,
  // and a process that loads several must not see them as one type
  py::class_<trellm::DecodeLayers>(m, "DecodeLayers", py::module_local(),
                                    "a decoder's layers for a step of few rows in one call (decode_layers.cpp)")
      .def(py::init<int64_t, int64_t, int64_t, double, double, double, bool, int64_t>(), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("scale"), py::arg("softcap"),
           py::arg("gelu"), py::arg("max_q_len"))
      .def("add_layer", &trellm::DecodeLayers::add_layer, py::arg("input_norm"), py::arg("post_norm"),
           py::arg("q_norm"), py::arg("k_norm"), py::arg("attn_out_norm"), py::arg("mlp_out_norm"),
           py::arg("cos_sin"), py::arg("window"))
      .def("add_linear", &trellm::DecodeLayers::add_linear, py::arg("kind"), py::arg("weight"), py::arg("scales"),
           py::arg("bias"), py::arg("group"))
      .def("forward", &trellm::DecodeLayers::forward, "(h, residual) after the last layer", no_gil)
      .def("set_timed", &trellm::DecodeLayers::set_timed, py::arg("timed"))
      .def("seconds", &trellm::DecodeLayers::seconds, "seconds of each part of the timed forwards since the last call");
}
