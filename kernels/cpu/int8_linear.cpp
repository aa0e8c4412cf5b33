// INT8-weight linear on a CPU: y[m, n] = scale[n] * sum_k x[m, k] * q[n, k], x and y float32 (with AVX2 alone, x is
// rounded to int16 per token for the products; see that branch); the driver is cpu/blocked_linear.h.
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
#include <ATen/ops/empty.h>

#include "blocked_linear.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "vec_math.h"

namespace {

using trellm::blocked_linear::BLOCK;

#if defined(__AVX512F__)
constexpr int64_t TILE_TOKENS = trellm::blocked_linear::MT_REGISTERS;
using TileInput = float;
constexpr int64_t TILE_K_ALIGN = 1;

// Each half of the k's 32 weights is widened straight from memory (one load folded into `vpmovsxbd`: loading all 32
// and extracting the upper half cost a shuffle more per k), and the next block is prefetched meanwhile, as in
// cpu/bf16_linear.cpp: together 2x the one-token rate (perf/RESULTS.md, "INT8 at one token").
template <int MT>
inline void int8_tile(trellm::blocked_linear::Rows<float> rows, int64_t K, const int8_t* blk, const int8_t* next,
                      const float* s, float* y, int64_t N) {
  const float* x = rows.x;
  __m512 acc0[MT], acc1[MT];
  for (int m = 0; m < MT; ++m) acc0[m] = acc1[m] = _mm512_setzero_ps();
  const int8_t* ahead = next != nullptr ? next : blk;   // unconditionally, as cpu/bf16_linear.cpp says why
  for (int64_t k = 0; k < K; ++k) {
    const int8_t* wk = blk + k * BLOCK;
    __builtin_prefetch(ahead + k * BLOCK, 0, 2);
    const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wk))));
    const __m512 w1 =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wk + 16))));
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
// AVX2 has no int8 dot product, and its fp32 FMAs make weight-only INT8 no faster than fp32 once a call has enough
// tokens for the arithmetic to dominate (48 tokens: level with oneDNN's fp32 while the weights were widened to fp32;
// perf/RESULTS.md, "INT8 with AVX2: the weights widened once per tile"). So here the activations are quantized too,
// per token to int16 (scale = max |x[m, :]| / 32767: each value within half a step, ~256x finer than the int8
// weights' own rounding and finer than bf16 activations), and the products run on `vpmaddwd`, which multiplies 16
// int16 pairs and adds adjacent ones (two k at once) into 8 int32 lanes: with its `vpaddd`, 1.6x the
// multiply-adds of `vfmadd231ps` per cycle on a Zen 3 (perf/RESULTS.md, "INT8 with AVX2: int16 activations").
// The int32 sums are exact; every KC k they are converted and added to float sums, so none can overflow
// (KC x 32767 x 127 < 2^31) and each y[m, n] is still summed in a fixed order whatever else shares the call.
constexpr int64_t KC = 256;           // k per exact int32 partial sum (kernels/linear.py's reference: the same)
constexpr int64_t TILE_TOKENS = 48;   // tokens that share one widening of a block's weights

// Rows k and k + 1 of a block's 32 int8 weights, interleaved and widened to int16: w[i] holds outputs 8i..8i+7,
// each as the pair (k, k + 1) that vpmaddwd multiplies with a token's (x[k], x[k + 1]).
inline void widen_pairs(const int8_t* row0, const int8_t* row1, __m256i w[4]) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row0));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row1));
  const __m128i a0 = _mm256_castsi256_si128(a), a1 = _mm256_extracti128_si256(a, 1);
  const __m128i b0 = _mm256_castsi256_si128(b), b1 = _mm256_extracti128_si256(b, 1);
  w[0] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a0, b0));
  w[1] = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(a0, b0));
  w[2] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a1, b1));
  w[3] = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(a1, b1));
}

alignas(32) constexpr int8_t ZERO_ROW[BLOCK] = {};

// Row k + 1 of the block, or zeros past an odd K (x's padding is zero too).
inline const int8_t* partner(const int8_t* blk, int64_t k, int64_t K) {
  return k + 1 < K ? blk + (k + 1) * BLOCK : ZERO_ROW;
}

// A token's (x[k], x[k + 1]) as one 32-bit lane, in all 8.
inline __m256i pair_of(const int16_t* x, int64_t k) {
  int32_t v;
  std::memcpy(&v, x + k, sizeof(v));
  return _mm256_set1_epi32(v);
}

// acc + v, added in place: written with _mm256_add_epi32, GCC 12 put each sum in the product's register and moved it
// back, 8 extra instructions per pair of k that cost the 2-token loop ~12% (the same loop in a one-off harness).
inline __m256i add_into(__m256i acc, __m256i v) {
  __asm__("vpaddd %1, %0, %0" : "+x"(acc) : "x"(v));
  return acc;
}

// The G tokens' int32 sums over one chunk, added to their float sums (`first`: the chunk that starts them).
template <int G>
inline void add_chunk(const __m256i acc[G][4], float* sums, bool first) {
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) {
      const __m256 f = _mm256_cvtepi32_ps(acc[g][i]);
      float* s = sums + g * BLOCK + 8 * i;
      _mm256_storeu_ps(s, first ? f : _mm256_add_ps(_mm256_loadu_ps(s), f));
    }
}

// G tokens over k in [k0, k1), widening each pair of weight rows in registers: for tiles of 1 or 2 tokens, where a
// buffer would be written and read for little reuse.
template <int G>
inline void group_widening(const int16_t* x, int64_t ldx, int64_t K, const int8_t* blk, int64_t k0, int64_t k1,
                           float* sums) {
  __m256i acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) acc[g][i] = _mm256_setzero_si256();
  for (int64_t k = k0; k < k1; k += 2) {
    __m256i w[4];
    widen_pairs(blk + k * BLOCK, partner(blk, k, K), w);
    for (int g = 0; g < G; ++g) {
      const __m256i xb = pair_of(x + g * ldx, k);
      for (int i = 0; i < 4; ++i) acc[g][i] = add_into(acc[g][i], _mm256_madd_epi16(w[i], xb));
    }
  }
  add_chunk<G>(acc, sums, k0 == 0);
}

// G tokens over the chunk's widened pairs `wp` (4 vectors per pair of k, from k0).
template <int G>
inline void group(const int16_t* x, int64_t ldx, int64_t k0, int64_t pairs, const __m256i* wp, float* sums) {
  __m256i acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) acc[g][i] = _mm256_setzero_si256();
  for (int64_t p = 0; p < pairs; ++p) {
    __m256i xb[G];
    for (int g = 0; g < G; ++g) xb[g] = pair_of(x + g * ldx, k0 + 2 * p);
    for (int i = 0; i < 4; ++i) {
      const __m256i w = _mm256_load_si256(wp + 4 * p + i);
      for (int g = 0; g < G; ++g) acc[g][i] = add_into(acc[g][i], _mm256_madd_epi16(w, xb[g]));
    }
  }
  add_chunk<G>(acc, sums, k0 == 0);
}

// A tile of up to 48 tokens: the block's weights are widened once per chunk into an L1 buffer (16 KiB) that every
// group of 2 tokens reads (8 sums, 2 broadcasts and the products fit AVX2's 16 registers; with 3, GCC kept sums on
// the stack and the tile ran at half speed), so the more tokens share the tile, the less widening per product.
inline void int8_tile_avx2(const int16_t* x, int64_t ldx, const float* xs, int64_t K, const int8_t* blk,
                           const float* s, float* y, int64_t N, int mt) {
  float sums[TILE_TOKENS * BLOCK];
  alignas(32) __m256i wp[KC / 2 * 4];
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t k1 = std::min(K, k0 + KC);
    if (mt <= 2) {
      if (mt == 2) group_widening<2>(x, ldx, K, blk, k0, k1, sums);
      if (mt == 1) group_widening<1>(x, ldx, K, blk, k0, k1, sums);
      continue;
    }
    const int64_t pairs = (k1 - k0 + 1) / 2;
    for (int64_t p = 0, k = k0; p < pairs; ++p, k += 2) widen_pairs(blk + k * BLOCK, partner(blk, k, K), wp + 4 * p);
    int m = 0;
    for (; m + 2 <= mt; m += 2) group<2>(x + m * ldx, ldx, k0, pairs, wp, sums + m * BLOCK);
    if (mt - m == 1) group<1>(x + m * ldx, ldx, k0, pairs, wp, sums + m * BLOCK);
  }
  for (int m = 0; m < mt; ++m) {
    const __m256 xm = _mm256_set1_ps(xs[m]);
    for (int i = 0; i < 4; ++i)
      _mm256_storeu_ps(y + m * N + 8 * i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(sums + m * BLOCK + 8 * i),
                                                                       _mm256_loadu_ps(s + 8 * i)), xm));
  }
}

// x [M, K] float32 -> [M, K rounded up to even] int16 and one scale per row: q = round(x / scale), scale =
// max |x[m, :]| / 32767 (1 for a row of zeros).
std::pair<at::Tensor, at::Tensor> quantize_rows_int16(at::Tensor x) {
  const int64_t M = x.size(0), K = x.size(1), ldx = K + (K & 1);
  auto q = at::empty({M, ldx}, x.options().dtype(at::kShort));
  auto scales = at::empty({M}, x.options());
  const float* xp = x.data_ptr<float>();
  int16_t* qp = q.data_ptr<int16_t>();
  float* sp = scales.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = xp + m * K;
      int16_t* out = qp + m * ldx;
      __m256 amax8 = _mm256_setzero_ps();
      const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
      int64_t k = 0;
      for (; k + 8 <= K; k += 8) amax8 = _mm256_max_ps(amax8, _mm256_and_ps(_mm256_loadu_ps(row + k), abs_mask));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, amax8);
      float amax = *std::max_element(lanes, lanes + 8);
      for (; k < K; ++k) amax = std::max(amax, std::fabs(row[k]));
      const float scale = amax > 0 ? amax / 32767.0f : 1.0f, inv = amax > 0 ? 32767.0f / amax : 1.0f;
      sp[m] = scale;
      const __m256 inv8 = _mm256_set1_ps(inv);
      for (k = 0; k + 16 <= K; k += 16) {
        const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + k), inv8));
        const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + k + 8), inv8));
        // packs works within 128-bit lanes: restore the order of the 16 values.
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8));
      }
      for (; k < K; ++k) out[k] = static_cast<int16_t>(std::clamp(std::nearbyint(row[k] * inv), -32767.0f, 32767.0f));
      if (ldx > K) out[K] = 0;
    }
  });
  return {q, scales};
}

using TileInput = int16_t;
constexpr int64_t TILE_K_ALIGN = 2;

template <int MT>
inline void int8_tile(trellm::blocked_linear::Rows<int16_t> rows, int64_t K, const int8_t* blk,
                      const int8_t* /*next*/, const float* s, float* y, int64_t N) {
  int8_tile_avx2(rows.x, rows.ldx, rows.scales, K, blk, s, y, N, MT);
}
#else   // portable: GCC/Clang vector types (slower; AVX-512 and AVX2 hosts take the branches above)
constexpr int64_t TILE_TOKENS = trellm::blocked_linear::MT_REGISTERS;
using TileInput = float;
constexpr int64_t TILE_K_ALIGN = 1;
typedef int8_t v16i8 __attribute__((vector_size(16)));

template <int MT>
inline void int8_tile(trellm::blocked_linear::Rows<float> rows, int64_t K, const int8_t* blk, const int8_t* /*next*/,
                      const float* s, float* y, int64_t N) {
  const float* x = rows.x;
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
  using Input = TileInput;
  static constexpr int64_t K_ALIGN = TILE_K_ALIGN;
  static constexpr int64_t K_GROUP = 1;
  static constexpr int64_t MT_MAX = TILE_TOKENS;

  template <int MT>
  static void tile(trellm::blocked_linear::Rows<Input> rows, int64_t K, const int8_t* blk, const int8_t* next,
                   const float* scales, float* y, int64_t N) {
    int8_tile<MT>(rows, K, blk, next, scales, y, N);
  }
};

}  // namespace

void int8_linear_cpu(at::Tensor y, at::Tensor x, at::Tensor packed, at::Tensor scales) {
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
              scales.numel() == packed.size(0) * BLOCK, "int8_linear: float32 scales, one per output");
#if defined(TRELLM_AVX2)
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(1) == packed.size(1),
              "int8_linear: x must be contiguous float32 [M, ", packed.size(1), "]");
  const auto [q, x_scales] = quantize_rows_int16(x);
  trellm::blocked_linear::run<Int8Kernel>("int8_linear", y, q, x_scales.data_ptr<float>(), packed,
                                          scales.data_ptr<float>());
#else
  trellm::blocked_linear::run<Int8Kernel>("int8_linear", y, x, nullptr, packed, scales.data_ptr<float>());
#endif
}
