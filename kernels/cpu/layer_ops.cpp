// The elementwise steps of a decoder layer on a CPU: RMSNorm (alone and fused with the residual add), rotary
// embedding, SiLU-and-mul, and the KV-cache write.
//
// Why: in PyTorch each of these is several ops, each a pass over memory, an allocation and a dispatch; together
// they cost a sixth of a prefill step and a fifth of a small decode step. Here each is one pass, computed in float
// and rounded to the tensor's dtype where the references in kernels/*.py round (they stay the tests' oracle).
// Rows are split across torch's thread pool only when there is enough work to pay for waking it.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

#include "vec_math.h"

namespace {

using trellm::f32;
using trellm::round_to;

constexpr int64_t kElementsPerTask = 32768;  // below this many elements per thread, one thread does it all

int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(row_elements, 1));
}

// Hugging Face order: the mean of squares and the normalisation in float, the result rounded to the dtype, then
// multiplied by the weight in the dtype.
template <typename scalar_t>
inline void norm_row(const scalar_t* x, const scalar_t* w, scalar_t* out, int64_t C, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < C; ++c) sum += f32(x[c]) * f32(x[c]);
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(C) + eps);
#pragma omp simd
  for (int64_t c = 0; c < C; ++c)
    out[c] = round_to<scalar_t>(f32(w[c]) * f32(round_to<scalar_t>(f32(x[c]) * inv)));
}

template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, const scalar_t* w, scalar_t* out, int64_t N, int64_t C, float eps) {
  at::parallel_for(0, N, grain_rows(C), [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) norm_row(x + n * C, w, out + n * C, C, eps);
  });
}

template <typename scalar_t>
void add_rms_norm_rows(const scalar_t* x, const scalar_t* residual, const scalar_t* w, scalar_t* out,
                       scalar_t* res_out, int64_t N, int64_t C, float eps) {
  at::parallel_for(0, N, grain_rows(C), [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      const scalar_t* xr = x + n * C;
      const scalar_t* rr = residual + n * C;
      scalar_t* ro = res_out + n * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) ro[c] = round_to<scalar_t>(f32(xr[c]) + f32(rr[c]));
      norm_row(ro, w, out + n * C, C, eps);
    }
  });
}

template <typename scalar_t>
inline void rotate_head(scalar_t* x, const float* c, const float* s, int64_t half) {
  // The reference multiplies in the dtype: cos and sin are rounded to it first.
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float ci = f32(round_to<scalar_t>(c[i])), si = f32(round_to<scalar_t>(s[i]));
    const float x1 = f32(x[i]), x2 = f32(x[i + half]);
    x[i] = round_to<scalar_t>(x1 * ci - x2 * si);
    x[i + half] = round_to<scalar_t>(x2 * ci + x1 * si);
  }
}

template <typename scalar_t>
void rotary_rows(scalar_t* q, scalar_t* k, const int32_t* pos, const float* cos_sin, int64_t T, int64_t H,
                 int64_t KVH, int64_t D, int64_t R) {
  const int64_t half = R / 2;
  at::parallel_for(0, T, grain_rows((H + KVH) * D), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* c = cos_sin + pos[t] * R;
      for (int64_t h = 0; h < H; ++h) rotate_head(q + (t * H + h) * D, c, c + half, half);
      for (int64_t h = 0; h < KVH; ++h) rotate_head(k + (t * KVH + h) * D, c, c + half, half);
    }
  });
}

template <typename scalar_t>
void silu_and_mul_rows(const scalar_t* x, scalar_t* out, int64_t N, int64_t I) {
  at::parallel_for(0, N, grain_rows(2 * I), [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      const scalar_t* g = x + n * 2 * I;
      const scalar_t* u = g + I;
      scalar_t* o = out + n * I;
      int64_t i = 0;
      for (; i + 16 <= I; i += 16) {   // 16 lanes: exp_approx's scalar loop did not vectorize (vec_math.h, exp16)
        const trellm::v16 gv = trellm::load16(g + i);
        const trellm::v16 act = trellm::rounded16<scalar_t>(gv / (1.f + trellm::exp16(-gv)));
        trellm::store16(o + i, act * trellm::load16(u + i));
      }
      for (; i < I; ++i) {
        // silu rounded to the dtype before the product, as F.silu(gate) * up does.
        const scalar_t act = round_to<scalar_t>(f32(g[i]) / (1.f + trellm::exp_approx(-f32(g[i]))));
        o[i] = round_to<scalar_t>(f32(act) * f32(u[i]));
      }
    }
  });
}

// Each row of x rounded to int8 with its own scale, max |x[m, :]| / 127 (1 for a row of zeros): the activations
// of oneDNN's W8A8 GEMM (kernels/linear.py, w8a8_linear), in one pass over x where torch takes five. The same
// float32 steps as linear.per_token_rounding (127 / amax, x * that, nearest even), so the two agree bit for bit.
template <typename scalar_t>
void quantize_rows_int8_rows(const scalar_t* x, int8_t* q, float* scales, int64_t M, int64_t K) {
  at::parallel_for(0, M, grain_rows(K), [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      const scalar_t* row = x + m * K;
      int8_t* out = q + m * K;
      float amax = 0.f;
#pragma omp simd reduction(max : amax)
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(f32(row[k])));
      const float inv = amax > 0 ? 127.f / amax : 1.f;
      scales[m] = amax > 0 ? amax / 127.f : 1.f;
#pragma omp simd
      for (int64_t k = 0; k < K; ++k)
        out[k] = static_cast<int8_t>(std::min(std::max(std::nearbyint(f32(row[k]) * inv), -127.f), 127.f));
    }
  });
}

}  // namespace

void quantize_rows_int8_cpu(at::Tensor q, at::Tensor scales, at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && q.is_contiguous() && q.scalar_type() == at::kChar &&
                  q.sizes() == x.sizes() && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == x.size(0),
              "quantize_rows_int8: x contiguous [M, K], q int8 [M, K], scales float32 [M]");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_rows_int8", [&] {
    quantize_rows_int8_rows(x.data_ptr<scalar_t>(), q.data_ptr<int8_t>(), scales.data_ptr<float>(), x.size(0),
                            x.size(1));
  });
}

// out[n, :] = rms_norm(x[n, :]) * weight. x, out: [N, C] contiguous; weight [C] of x's dtype.
void rms_norm_cpu(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  const int64_t C = x.size(-1), N = x.numel() / C;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_cpu", [&] {
    rms_norm_rows(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), N, C,
                  static_cast<float>(eps));
  });
}

// res_out = x + residual (rounded to the dtype), out = rms_norm(res_out) * weight. All [N, C] contiguous; out and
// res_out may be x and residual themselves.
void fused_add_rms_norm_cpu(at::Tensor out, at::Tensor res_out, at::Tensor x, at::Tensor residual,
                            at::Tensor weight, double eps) {
  const int64_t C = x.size(-1), N = x.numel() / C;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm_cpu", [&] {
    add_rms_norm_rows(x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                      out.data_ptr<scalar_t>(), res_out.data_ptr<scalar_t>(), N, C, static_cast<float>(eps));
  });
}

// In place, rotate-half convention: q [T, H, D], k [T, KVH, D] contiguous; positions [T] int32; cos_sin
// [max_pos, R] float holding cos in its first R/2 columns and sin in the last R/2; columns R.. pass through.
void rotary_cpu(at::Tensor q, at::Tensor k, at::Tensor positions, at::Tensor cos_sin) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_cpu", [&] {
    rotary_rows(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), positions.data_ptr<int32_t>(),
                cos_sin.data_ptr<float>(), q.size(0), q.size(1), k.size(1), q.size(2), cos_sin.size(1));
  });
}

// out [N, I] = silu(x[:, :I]) * x[:, I:], x [N, 2I] contiguous.
void silu_and_mul_cpu(at::Tensor out, at::Tensor x) {
  const int64_t I = out.size(-1), N = out.numel() / I;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul_cpu", [&] {
    silu_and_mul_rows(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), N, I);
  });
}

// k_cache[slot], v_cache[slot] = k[t], v[t] for every t whose slot_mapping[t] >= 0. k, v: [T, KVH, D] with each
// token's KVH * D values contiguous (any stride between tokens: views into a merged qkv work as they are);
// caches [num_blocks, block_size, KVH, D] contiguous, of k's dtype; slot_mapping [T] int32.
void write_kv_cpu(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
                  at::Tensor slot_mapping) {
  const int64_t T = k.size(0), es = k.element_size();
  const int64_t bytes = k.size(1) * k.size(2) * es, k_step = k.stride(0) * es, v_step = v.stride(0) * es;
  const int32_t* slots = slot_mapping.data_ptr<int32_t>();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  at::parallel_for(0, T, grain_rows(2 * bytes / es), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      if (slots[t] < 0) continue;
      std::memcpy(kc + slots[t] * bytes, kp + t * k_step, bytes);
      std::memcpy(vc + slots[t] * bytes, vp + t * v_step, bytes);
    }
  });
}

namespace {

// The quantizing KV write of an INT8 or FP8 cache: per token and KV head, amax -> float16 scale -> x / scale rounded
// into the cache (kernels/kv_cache.py defines the steps; this follows them exactly, in float). The caches come as
// int8 views of their bytes; `is_int8` picks the format.
template <typename scalar_t>
void write_kv_quantized_rows(const scalar_t* x, int64_t x_step, int8_t* cache, at::Half* scales, const int32_t* slots,
                             int64_t T, int64_t KVH, int64_t D, bool is_int8) {
  const float qmax = is_int8 ? 127.f : 448.f;
  at::parallel_for(0, T, grain_rows(2 * KVH * D), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      if (slots[t] < 0) continue;
      for (int64_t h = 0; h < KVH; ++h) {
        const scalar_t* row = x + t * x_step + h * D;
        float amax = 0.f;
        for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(f32(row[d])));
        const at::Half s = static_cast<at::Half>(std::max(amax / qmax, 6.103515625e-05f));
        const float sf = static_cast<float>(s);
        int8_t* out = cache + (static_cast<int64_t>(slots[t]) * KVH + h) * D;
        scales[static_cast<int64_t>(slots[t]) * KVH + h] = s;
        if (is_int8) {
#pragma omp simd
          for (int64_t d = 0; d < D; ++d)
            out[d] = static_cast<int8_t>(std::min(std::max(std::nearbyint(f32(row[d]) / sf), -127.f), 127.f));
        } else {
          for (int64_t d = 0; d < D; ++d)
            out[d] = static_cast<int8_t>(trellm::fp8_e4m3_bits(std::min(std::max(f32(row[d]) / sf, -448.f), 448.f)));
        }
      }
    }
  });
}

}  // namespace

void write_kv_quantized_cpu(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor k_scale, at::Tensor v_scale, at::Tensor slot_mapping, bool is_int8) {
  TORCH_CHECK(k_cache.scalar_type() == at::kChar && v_cache.scalar_type() == at::kChar &&
                  k_scale.scalar_type() == at::kHalf && v_scale.scalar_type() == at::kHalf,
              "write_kv_quantized: caches as int8 views, scales float16");
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2);
  const int32_t* slots = slot_mapping.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, k.scalar_type(), "write_kv_quantized", [&] {
    write_kv_quantized_rows<scalar_t>(k.data_ptr<scalar_t>(), k.stride(0), k_cache.data_ptr<int8_t>(),
                                      k_scale.data_ptr<at::Half>(), slots, T, KVH, D, is_int8);
    write_kv_quantized_rows<scalar_t>(v.data_ptr<scalar_t>(), v.stride(0), v_cache.data_ptr<int8_t>(),
                                      v_scale.data_ptr<at::Half>(), slots, T, KVH, D, is_int8);
  });
}

namespace {

// Blocks of an INT8 / FP8 cache as float or bfloat16 values (value x its token-and-head scale), for the fused
// prefill attention, which needs its chunk's keys and values gathered anyway.
template <typename out_t, typename kv_t>
void gather_dequantize_rows(out_t* out, const kv_t* cache, const at::Half* scales, const int64_t* blocks,
                            int64_t n_blocks, int64_t BS, int64_t KVH, int64_t D) {
  const int64_t rows = n_blocks * BS * KVH;   // one (slot, head) row of D values each
  at::parallel_for(0, rows, grain_rows(D), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t i = r / (BS * KVH), within = r % (BS * KVH);
      const int64_t src = blocks[i] * BS * KVH + within;
      const kv_t* x = cache + src * D;
      const float s = static_cast<float>(scales[src]);
      out_t* o = out + r * D;
      if (D % 16 == 0) {
        for (int64_t d = 0; d < D; d += 16) {
          trellm::store16(o + d, trellm::load16(x + d) * s);
        }
      } else {
        for (int64_t d = 0; d < D; ++d) o[d] = round_to<out_t>(static_cast<float>(x[d]) * s);
      }
    }
  });
}

}  // namespace

void gather_dequantize_cpu(at::Tensor out, at::Tensor cache, at::Tensor scales, at::Tensor blocks,
                           bool is_int8) {
  TORCH_CHECK(out.is_contiguous() && cache.is_contiguous() && scales.is_contiguous() &&
                  cache.scalar_type() == at::kChar && scales.scalar_type() == at::kHalf &&
                  blocks.scalar_type() == at::kLong && blocks.is_contiguous(),
              "gather_dequantize: contiguous out, int8 view of the cache, float16 scales, int64 block ids");
  const int64_t n = blocks.size(0), BS = cache.size(1), KVH = cache.size(2), D = cache.size(3);
  const int64_t* ids = blocks.data_ptr<int64_t>();
  const at::Half* sc = scales.data_ptr<at::Half>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, out.scalar_type(), "gather_dequantize", [&] {
    if (is_int8)
      gather_dequantize_rows(out.data_ptr<scalar_t>(), cache.data_ptr<int8_t>(), sc, ids, n, BS, KVH, D);
    else
      gather_dequantize_rows(out.data_ptr<scalar_t>(), reinterpret_cast<const trellm::fp8_e4m3*>(
          cache.data_ptr<int8_t>()), sc, ids, n, BS, KVH, D);
  });
}
