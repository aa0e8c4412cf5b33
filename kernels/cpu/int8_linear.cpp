// Weight-only INT8 linear on a CPU: y[m, n] = scale[n] * sum_k x[m, k] * q[n, k], x and y float32; the driver is
// cpu/blocked_linear.h.
//
// Why: a decode step reads every weight once, so int8 weights (a quarter of fp32's bytes) make that read up to 4x
// cheaper, but only if they are read once per call and widened in registers. torch's _weight_int8pack_mm was slower
// than fp32 oneDNN even for one token (perf/RESULTS.md, section "Weight-only INT8 on a CPU").
// Layout: packed at load (kernels/linear.py) into blocks of 32 outputs, [N/32][K][32] int8: for each k, the 32
// weights of the block's outputs are one 32-byte load, widened once into two 16-lane vectors and multiplied by each
// token's x[m, k] broadcast (an outer product, as a GEMM micro-kernel does): 24 FMAs for 12 tokens per 6 widening
// instructions, where the first version of this operator (16 k-lanes per output, folded at the end) spent about as
// many instructions widening as multiplying and fell well behind oneDNN's fp32 from 16 tokens up (the same
// section's table).
#include "blocked_linear.h"

#include <algorithm>
#include <cstring>

#include "vec_math.h"

namespace {

using trellm::blocked_linear::BLOCK;

#if defined(__AVX512F__)
constexpr int64_t TILE_TOKENS = trellm::blocked_linear::MT_REGISTERS;

template <int MT>
inline void int8_tile(const float* x, int64_t K, const int8_t* blk, const float* s, float* y, int64_t N) {
  __m512 acc0[MT], acc1[MT];
  for (int m = 0; m < MT; ++m) acc0[m] = acc1[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + k * BLOCK));
    const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
    const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
    for (int m = 0; m < MT; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * K + k]);
      acc0[m] = _mm512_fmadd_ps(w0, xb, acc0[m]);
      acc1[m] = _mm512_fmadd_ps(w1, xb, acc1[m]);
    }
  }
  const __m512 s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16);
  for (int m = 0; m < MT; ++m) {
    _mm512_storeu_ps(y + m * N, _mm512_mul_ps(acc0[m], s0));
    _mm512_storeu_ps(y + m * N + 16, _mm512_mul_ps(acc1[m], s1));
  }
}
#elif defined(TRELLM_AVX2)
// AVX2 only (16 registers): G <= 3 tokens at a time, 4 accumulators of 8 outputs each plus the block's 4 weight
// vectors. Widening the weights in that loop cost about as much as the products and ran each group's widening again,
// so with up to 48 tokens a tile widens the block once, KC rows of k at a time into an L1 buffer, and each group of 3
// tokens runs over the buffer (its sums kept in memory between chunks): at 48 tokens level with oneDNN's fp32 where
// the per-group widening took 1.5x as long (perf/RESULTS.md, "INT8 with AVX2: the weights widened once per tile").
// From 512 tokens kernels/linear.py dequantizes for one fp32 GEMM instead. The portable branch below ran well behind
// fp32 oneDNN on a Zen 3 (GCC moved its 16-lane sums through the stack; perf/RESULTS.md, "INT8 weights with AVX2
// only").
constexpr int64_t KC = 64;   // k rows per widened chunk: 64 x 32 floats = 8 KiB

// One k's 32 int8 weights of a block, widened to fp32: four vectors of 8 outputs.
inline void widen32(const int8_t* q8, __m256 w[4]) {
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8));
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
  w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
  w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

// G tokens over the whole block, widening each k's weights in registers: for a tile of 1 to 3 tokens, where a
// buffer would be written and read once for no reuse.
template <int G>
inline void group_widening(const float* x, int64_t K, const int8_t* blk, const float* s, float* y, int64_t N) {
  __m256 acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) acc[g][i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 w[4];
    widen32(blk + k * BLOCK, w);
    for (int g = 0; g < G; ++g) {
      const __m256 xb = _mm256_set1_ps(x[g * K + k]);
      for (int i = 0; i < 4; ++i) acc[g][i] = _mm256_fmadd_ps(w[i], xb, acc[g][i]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i)
      _mm256_storeu_ps(y + g * N + 8 * i, _mm256_mul_ps(acc[g][i], _mm256_loadu_ps(s + 8 * i)));
}

// G tokens over KC widened rows of k, their sums carried in `sums` from chunk to chunk.
template <int G>
inline void group(const float* x, int64_t K, int64_t k0, int64_t kc, const float* wf, float* sums) {
  __m256 acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) acc[g][i] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + g * BLOCK + 8 * i);
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 w[4] = {_mm256_load_ps(wf + k * BLOCK), _mm256_load_ps(wf + k * BLOCK + 8),
                         _mm256_load_ps(wf + k * BLOCK + 16), _mm256_load_ps(wf + k * BLOCK + 24)};
    for (int g = 0; g < G; ++g) {
      const __m256 xb = _mm256_set1_ps(x[g * K + k0 + k]);
      for (int i = 0; i < 4; ++i) acc[g][i] = _mm256_fmadd_ps(w[i], xb, acc[g][i]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(sums + g * BLOCK + 8 * i, acc[g][i]);
}

// A tile of up to 48 tokens: its sums live in memory between chunks anyway, so the more tokens share one widening
// of the block, the less widening per product (at 48 tokens, once per block instead of once per 3 tokens).
constexpr int64_t TILE_TOKENS = 48;

inline void int8_tile_avx2(const float* x, int64_t K, const int8_t* blk, const float* s, float* y, int64_t N,
                           int mt) {
  if (mt <= 3) {
    if (mt == 3) group_widening<3>(x, K, blk, s, y, N);
    if (mt == 2) group_widening<2>(x, K, blk, s, y, N);
    if (mt == 1) group_widening<1>(x, K, blk, s, y, N);
    return;
  }
  alignas(32) float wf[KC * BLOCK];
  float sums[TILE_TOKENS * BLOCK];
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = std::min(KC, K - k0);
    for (int64_t k = 0; k < kc; ++k) {
      __m256 w[4];
      widen32(blk + (k0 + k) * BLOCK, w);
      for (int i = 0; i < 4; ++i) _mm256_store_ps(wf + k * BLOCK + 8 * i, w[i]);
    }
    int m = 0;
    for (; m + 3 <= mt; m += 3) group<3>(x + m * K, K, k0, kc, wf, sums + m * BLOCK);
    if (mt - m == 2) group<2>(x + m * K, K, k0, kc, wf, sums + m * BLOCK);
    if (mt - m == 1) group<1>(x + m * K, K, k0, kc, wf, sums + m * BLOCK);
  }
  for (int m = 0; m < mt; ++m)
    for (int i = 0; i < 4; ++i)
      _mm256_storeu_ps(y + m * N + 8 * i, _mm256_mul_ps(_mm256_loadu_ps(sums + m * BLOCK + 8 * i),
                                                        _mm256_loadu_ps(s + 8 * i)));
}

template <int MT>
inline void int8_tile(const float* x, int64_t K, const int8_t* blk, const float* s, float* y, int64_t N) {
  int8_tile_avx2(x, K, blk, s, y, N, MT);
}
#else   // portable: GCC/Clang vector types (slower; AVX-512 and AVX2 hosts take the branches above)
constexpr int64_t TILE_TOKENS = trellm::blocked_linear::MT_REGISTERS;
typedef int8_t v16i8 __attribute__((vector_size(16)));

template <int MT>
inline void int8_tile(const float* x, int64_t K, const int8_t* blk, const float* s, float* y, int64_t N) {
  using trellm::v16;
  v16 acc0[MT], acc1[MT];
  for (int m = 0; m < MT; ++m) acc0[m] = acc1[m] = v16{};
  for (int64_t k = 0; k < K; ++k) {
    v16i8 q0, q1;
    std::memcpy(&q0, blk + k * BLOCK, sizeof(q0));
    std::memcpy(&q1, blk + k * BLOCK + 16, sizeof(q1));
    const v16 w0 = __builtin_convertvector(__builtin_convertvector(q0, trellm::vi16), v16);
    const v16 w1 = __builtin_convertvector(__builtin_convertvector(q1, trellm::vi16), v16);
    for (int m = 0; m < MT; ++m) {
      const float xb = x[m * K + k];
      acc0[m] += w0 * xb;
      acc1[m] += w1 * xb;
    }
  }
  const v16 s0 = trellm::load16(s), s1 = trellm::load16(s + 16);
  for (int m = 0; m < MT; ++m) {
    const v16 r0 = acc0[m] * s0, r1 = acc1[m] * s1;
    std::memcpy(y + m * N, &r0, sizeof(r0));
    std::memcpy(y + m * N + 16, &r1, sizeof(r1));
  }
}
#endif

struct Int8Kernel {
  using Weight = int8_t;
  static constexpr int64_t MT_MAX = TILE_TOKENS;

  template <int MT>
  static void tile(const float* x, int64_t K, const int8_t* blk, const int8_t* /*next*/, const float* scales,
                   float* y, int64_t N) {
    int8_tile<MT>(x, K, blk, scales, y, N);
  }
};

}  // namespace

void int8_linear_cpu(torch::Tensor y, torch::Tensor x, torch::Tensor packed, torch::Tensor scales) {
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() &&
              scales.numel() == packed.size(0) * BLOCK, "int8_linear: float32 scales, one per output");
  trellm::blocked_linear::run<Int8Kernel>("int8_linear", y, x, packed, scales.data_ptr<float>());
}
