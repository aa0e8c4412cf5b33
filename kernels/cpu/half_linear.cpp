// bf16 and fp16 weights on a CPU with AVX2 alone: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), x and y float32,
// the weight packed at load (kernels/linear.py) in the driver's blocks (cpu/blocked_linear.h).
//
// Why: such a CPU has no bf16 or fp16 dot products, and torch's half GEMM there multiplies one token row at a time
// (5-8x slower than fp32 from 16 tokens), so kernels/linear.py widened the whole weight to fp32 for each call of 4+
// tokens: a second pass over memory that made bf16 0.90x fp32 (perf/RESULTS.md, "bf16 on an AVX2 CPU"). Here each
// block is widened in L1, KC rows of k at a time, and multiplied in fp32 by up to 48 tokens in groups of 2: the
// weights are read from memory once, at half fp32's bytes, and a bf16 value widens with one shift.
#include "blocked_linear.h"

#include "vec_math.h"

#if defined(TRELLM_AVX2)

namespace {

using trellm::blocked_linear::BLOCK;

constexpr int64_t KC = 64;            // k rows per widened chunk: 64 x 32 floats = 8 KiB
constexpr int64_t TILE_TOKENS = 48;   // tokens that share one widening of a block

// One k's 32 weights of a block, widened to fp32: four vectors of 8 outputs.
inline void widen32(const c10::BFloat16* h, __m256 w[4]) {
  for (int i = 0; i < 4; ++i) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 8 * i));
    w[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
}

inline void widen32(const c10::Half* h, __m256 w[4]) {
  for (int i = 0; i < 4; ++i) w[i] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 8 * i)));
}

// G tokens' sums over k in [k0, k0 + kc), the weights read from `wf` (widened, 32 per k) and the sums carried in
// `sums` from chunk to chunk.
template <int G>
inline void group(const float* x, int64_t ldx, int64_t k0, int64_t kc, const float* wf, float* sums) {
  __m256 acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) acc[g][i] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + g * BLOCK + 8 * i);
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 w[4] = {_mm256_load_ps(wf + k * BLOCK), _mm256_load_ps(wf + k * BLOCK + 8),
                         _mm256_load_ps(wf + k * BLOCK + 16), _mm256_load_ps(wf + k * BLOCK + 24)};
    for (int g = 0; g < G; ++g) {
      const __m256 xb = _mm256_set1_ps(x[g * ldx + k0 + k]);
      for (int i = 0; i < 4; ++i) acc[g][i] = _mm256_fmadd_ps(w[i], xb, acc[g][i]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(sums + g * BLOCK + 8 * i, acc[g][i]);
}

// G tokens over the whole block, widening each k's weights in registers: for tiles of 1 to 3 tokens, where a buffer
// would be written and read for no reuse.
template <int G, class H>
inline void group_widening(const float* x, int64_t ldx, int64_t K, const H* blk, float* sums) {
  __m256 acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) acc[g][i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 w[4];
    widen32(blk + k * BLOCK, w);
    for (int g = 0; g < G; ++g) {
      const __m256 xb = _mm256_set1_ps(x[g * ldx + k]);
      for (int i = 0; i < 4; ++i) acc[g][i] = _mm256_fmadd_ps(w[i], xb, acc[g][i]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(sums + g * BLOCK + 8 * i, acc[g][i]);
}

template <class H>
struct HalfKernel {
  using Weight = H;
  using Input = float;
  static constexpr int64_t K_ALIGN = 1;
  static constexpr int64_t K_GROUP = 1;
  static constexpr int64_t MT_MAX = TILE_TOKENS;

  template <int MT>
  static void tile(trellm::blocked_linear::Rows<float> rows, int64_t K, const H* blk, const H* /*next*/,
                   const float* bias, float* y, int64_t N) {
    alignas(32) float wf[KC * BLOCK];
    float sums[MT * BLOCK];
    if constexpr (MT <= 3) {
      group_widening<MT>(rows.x, rows.ldx, K, blk, sums);
    } else {
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = std::min(KC, K - k0);
        for (int64_t k = 0; k < kc; ++k) {
          __m256 w[4];
          widen32(blk + (k0 + k) * BLOCK, w);
          for (int i = 0; i < 4; ++i) _mm256_store_ps(wf + k * BLOCK + 8 * i, w[i]);
        }
        int m = 0;
        for (; m + 2 <= MT; m += 2) group<2>(rows.x + m * rows.ldx, rows.ldx, k0, kc, wf, sums + m * BLOCK);
        if (MT - m == 1) group<1>(rows.x + m * rows.ldx, rows.ldx, k0, kc, wf, sums + m * BLOCK);
      }
    }
    for (int m = 0; m < MT; ++m)
      for (int i = 0; i < 4; ++i) {
        const __m256 s = _mm256_loadu_ps(sums + m * BLOCK + 8 * i);
        _mm256_storeu_ps(y + m * N + 8 * i, bias != nullptr ? _mm256_add_ps(s, _mm256_loadu_ps(bias + 8 * i)) : s);
      }
  }
};

}  // namespace

void half_linear_cpu(at::Tensor y, at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias) {
  const float* bp = trellm::blocked_linear::bias_data(bias, packed, "half_linear");
  if (packed.scalar_type() == at::kBFloat16)
    trellm::blocked_linear::run<HalfKernel<c10::BFloat16>>("half_linear", y, x, nullptr, packed, bp);
  else
    trellm::blocked_linear::run<HalfKernel<c10::Half>>("half_linear", y, x, nullptr, packed, bp);
}
#else
void half_linear_cpu(at::Tensor, at::Tensor, at::Tensor, c10::optional<at::Tensor>) {
  TORCH_CHECK(false, "half_linear: built without AVX2, or with AVX-512 (kernels/linear.py keeps torch's path there)");
}
#endif
