// Weight-only INT8 linear on a CPU: y[m, n] = scale[n] * sum_k x[m, k] * q[n, k], x and y float32.
//
// Why: a decode step reads every weight once, so int8 weights (a quarter of fp32's bytes) make that read up to 4x
// cheaper, but only if they are read once per call and widened in registers. torch's _weight_int8pack_mm ran at
// 0.45-0.64x of fp32 oneDNN for one token (perf/RESULTS.md).
// Layout: packed at load (kernels/linear.py) into blocks of 32 outputs, [N/32][K][32] int8: for each k, the 32
// weights of the block's outputs are one 32-byte load, widened once into two 16-lane vectors and multiplied by each
// token's x[m, k] broadcast (an outer product, as a GEMM micro-kernel does): 24 FMAs for 12 tokens per 6 widening
// instructions, where the first version of this operator (16 k-lanes per output, folded at the end) spent about as
// many instructions widening as multiplying and ran at half of oneDNN's fp32 rate from 16 tokens up. Each y[m, n]
// is summed over k in order in one lane whatever the tile, so a request's tokens do not change with the batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>

#include "vec_math.h"

namespace {

constexpr int64_t BLOCK = 32;       // outputs per packed block
constexpr int64_t MT_MAX = 12;      // tokens per tile: 24 accumulators + 2 weight vectors in 32 registers
constexpr int64_t M_CHUNK = 96;     // tokens whose x rows stay in L2 while the thread's blocks pass over them

#if defined(__AVX512F__)
template <int MT>
inline void tile(const float* x, int64_t K, const int8_t* blk, const float* s, float* y, int64_t N) {
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
// AVX2 only (16 registers): G <= 3 tokens at a time, 4 accumulators of 8 outputs each, so accumulators and the
// block's 4 weight vectors fit; a tile of MT tokens passes over the block's weights (16 KiB at K = 512, in L1/L2)
// once per group. The portable branch below ran at 0.4-0.5x of fp32 oneDNN on a Zen 3 (GCC moved its 16-lane sums
// through the stack).
template <int G>
inline void group(const float* x, int64_t K, const int8_t* blk, const float* s, float* y, int64_t N) {
  __m256 acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) acc[g][i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + k * BLOCK));
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    const __m256 w[4] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)),
                         _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))),
                         _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)),
                         _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)))};
    for (int g = 0; g < G; ++g) {
      const __m256 xb = _mm256_set1_ps(x[g * K + k]);
      for (int i = 0; i < 4; ++i) acc[g][i] = _mm256_fmadd_ps(w[i], xb, acc[g][i]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i)
      _mm256_storeu_ps(y + g * N + 8 * i, _mm256_mul_ps(acc[g][i], _mm256_loadu_ps(s + 8 * i)));
}

template <int MT>
inline void tile(const float* x, int64_t K, const int8_t* blk, const float* s, float* y, int64_t N) {
  int m = 0;
  for (; m + 3 <= MT; m += 3) group<3>(x + m * K, K, blk, s, y + m * N, N);
  if (MT - m == 2) group<2>(x + m * K, K, blk, s, y + m * N, N);
  if (MT - m == 1) group<1>(x + m * K, K, blk, s, y + m * N, N);
}
#else   // portable: GCC/Clang vector types (slower; AVX-512 and AVX2 hosts take the branches above)
typedef int8_t v16i8 __attribute__((vector_size(16)));

template <int MT>
inline void tile(const float* x, int64_t K, const int8_t* blk, const float* s, float* y, int64_t N) {
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

// y rows [m0, m1) of block b: tiles of 12 tokens, then one tile of what is left.
inline void block_tokens(const float* x, int64_t K, const int8_t* blk, const float* s, float* y, int64_t N,
                         int64_t m0, int64_t m1) {
  int64_t m = m0;
  for (; m + MT_MAX <= m1; m += MT_MAX) tile<MT_MAX>(x + m * K, K, blk, s, y + m * N, N);
  switch (m1 - m) {
    case 0: break;
    case 1: tile<1>(x + m * K, K, blk, s, y + m * N, N); break;
    case 2: tile<2>(x + m * K, K, blk, s, y + m * N, N); break;
    case 3: tile<3>(x + m * K, K, blk, s, y + m * N, N); break;
    case 4: tile<4>(x + m * K, K, blk, s, y + m * N, N); break;
    case 5: tile<5>(x + m * K, K, blk, s, y + m * N, N); break;
    case 6: tile<6>(x + m * K, K, blk, s, y + m * N, N); break;
    case 7: tile<7>(x + m * K, K, blk, s, y + m * N, N); break;
    case 8: tile<8>(x + m * K, K, blk, s, y + m * N, N); break;
    case 9: tile<9>(x + m * K, K, blk, s, y + m * N, N); break;
    case 10: tile<10>(x + m * K, K, blk, s, y + m * N, N); break;
    default: tile<11>(x + m * K, K, blk, s, y + m * N, N); break;
  }
}

}  // namespace

void int8_linear_cpu(torch::Tensor y, torch::Tensor x, torch::Tensor packed, torch::Tensor scales) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && y.scalar_type() == torch::kFloat32 &&
              scales.scalar_type() == torch::kFloat32 && packed.scalar_type() == torch::kInt8,
              "int8_linear: float32 x, y and scales, int8 packed weight");
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && packed.is_contiguous() && scales.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), N = NB * BLOCK;
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == K && packed.size(2) == BLOCK,
              "int8_linear: the weight must be packed [N/32, K, 32]");
  TORCH_CHECK(y.size(0) == M && y.size(1) == N && scales.numel() == N);
  const float* xp = x.data_ptr<float>();
  const int8_t* w = packed.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t m0 = 0; m0 < M; m0 += M_CHUNK) {
      const int64_t m1 = std::min(M, m0 + M_CHUNK);
      for (int64_t b = b0; b < b1; ++b)
        block_tokens(xp, K, w + b * K * BLOCK, sp + b * BLOCK, yp + b * BLOCK, N, m0, m1);
    }
  });
}
