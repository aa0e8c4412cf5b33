// Weight-only INT8 linear on a CPU: y[m, n] = scale[n] * sum_k x[m, k] * q[n, k], x and y float32.
//
// Why: a decode step reads every weight once, so int8 rows (a quarter of fp32's bytes) make it up to 4x cheaper,
// but only if the weights are read once per call and widened in registers. torch's _weight_int8pack_mm ran at
// 0.45-0.64x of fp32 oneDNN for one token (2.4 GB/s); this reads at 20-29 GB/s there (perf/RESULTS.md).
// Layout: packed at load (kernels/linear.py) into blocks of 8 rows, [N/8][K/16][8][16] int8, so each block is one
// contiguous stream while its 8 rows x MT tokens of sums stay in registers. Each (token, row) sum keeps 16 lanes in
// a fixed order over k and is folded once at the end: a row's result does not depend on how many tokens share the
// call, so a request's tokens do not change with the batch it runs in.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "vec_math.h"

namespace {

using trellm::v16;
typedef int8_t v16i8 __attribute__((vector_size(16)));

inline float fold(v16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// Rows R0 .. R0+R-1 of the 8-row block `blk` (first row n0) for MT tokens of x.
#if defined(__AVX512F__)
template <int MT, int R, int R0>
inline void block_rows(const float* x, int64_t K, const int8_t* blk, const float* scales, float* y, int64_t N,
                       int64_t n0) {
  __m512 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t kc = 0; kc < K / 16; ++kc) {
    const int8_t* p = blk + kc * 128 + R0 * 16;
    _mm_prefetch(reinterpret_cast<const char*>(blk + kc * 128 + 1024), _MM_HINT_T0);
    __m512 xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = _mm512_loadu_ps(x + m * K + kc * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + r * 16))));
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_fmadd_ps(w, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) y[m * N + n0 + R0 + r] = _mm512_reduce_add_ps(acc[r][m]) * scales[n0 + R0 + r];
}
#else   // portable: GCC/Clang vector types (slower; AVX-512 hosts take the branch above)
template <int MT, int R, int R0>
inline void block_rows(const float* x, int64_t K, const int8_t* blk, const float* scales, float* y, int64_t N,
                       int64_t n0) {
  v16 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = v16{};
  for (int64_t kc = 0; kc < K / 16; ++kc) {
    const int8_t* p = blk + kc * 128 + R0 * 16;
    v16 xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = trellm::load16(x + m * K + kc * 16);
    for (int r = 0; r < R; ++r) {
      v16i8 q;
      std::memcpy(&q, p + r * 16, sizeof(q));
      const v16 w = __builtin_convertvector(__builtin_convertvector(q, trellm::vi16), v16);
      for (int m = 0; m < MT; ++m) acc[r][m] += w * xv[m];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) y[m * N + n0 + R0 + r] = fold(acc[r][m]) * scales[n0 + R0 + r];
}
#endif

}  // namespace

void int8_linear_cpu(torch::Tensor y, torch::Tensor x, torch::Tensor packed, torch::Tensor scales) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && y.scalar_type() == torch::kFloat32 &&
              scales.scalar_type() == torch::kFloat32 && packed.scalar_type() == torch::kInt8,
              "int8_linear: float32 x, y and scales, int8 packed weight");
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && packed.is_contiguous() && scales.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), N = NB * 8;
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) * 16 == K && packed.size(2) == 8 && packed.size(3) == 16,
              "int8_linear: the weight must be packed [N/8, K/16, 8, 16]");
  TORCH_CHECK(y.size(0) == M && y.size(1) == N && scales.numel() == N);
  const float* xp = x.data_ptr<float>();
  const int8_t* w = packed.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, NB, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int8_t* blk = w + b * 8 * K;
      const int64_t n0 = b * 8;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) {
        block_rows<4, 4, 0>(xp + m * K, K, blk, sp, yp + m * N, N, n0);
        block_rows<4, 4, 4>(xp + m * K, K, blk, sp, yp + m * N, N, n0);
      }
      for (; m + 2 <= M; m += 2) block_rows<2, 8, 0>(xp + m * K, K, blk, sp, yp + m * N, N, n0);
      for (; m < M; ++m) block_rows<1, 8, 0>(xp + m * K, K, blk, sp, yp + m * N, N, n0);
    }
  });
}
