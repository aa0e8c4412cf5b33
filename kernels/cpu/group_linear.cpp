// Group-quantized linear on a CPU: y[m, n] = sum_g (s[g, n] * sum_{k in g} x[m, k] * q[n, k] - min[g, n] *
// sum_{k in g} x[m, k]), a float32 scale (and, in formats with one, a minimum) per output and group of G = 16 or 32
// inputs (G = 64 or 128 too: INT4's groups), x and y float32. GGUF's blocks read exactly (kernels/group_quant.py):
// Q8_0, Q5_K and Q6_K as int8 q, Q4_0, Q4_1 and Q4_K as 4-bit q (0..15) two to a byte, so a 4-bit file is read at
// its own size; and INT4 weights (int4.py) as their nibbles, with z * s as the minimum.
// Layout (the driver, cpu/blocked_linear.h): blocks of 32 outputs, int8 [N/32][K][32] or, for 4 bits, bytes
// [N/32][K/2][32] whose low nibble is input 2i and high nibble input 2i + 1; the scales per block and group
// [N/32][K/G][S][32] (S = 2: the scales, then the minimums). Each group's sums start at zero and are scaled into the
// token's total once, so registers hold two sums per token and output half: 6 tokens per tile.
// Each row's group sums of x are taken once per call, in one fixed order, so a token's result does not depend on
// the call's other tokens.
#include <ATen/ops/empty.h>

#include "blocked_linear.h"

#include <cstring>
#include <type_traits>

#include "vec_math.h"

namespace {

using trellm::blocked_linear::BLOCK;

#if defined(__AVX512F__)
using Vec = __m512;
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec broadcast(float v) { return _mm512_set1_ps(v); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec madd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec nmadd(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec widen_s8(const int8_t* p) {   // 16 int8 -> 16 floats (the load folded into vpmovsxbd)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// 32 bytes of nibbles -> the 32 outputs' values of input 2i (low nibbles) and 2i + 1 (high), as four 16-lane halves.
inline void widen_nibbles(const uint8_t* p, Vec w[4]) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i mask = _mm256_set1_epi8(15);
  const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
  w[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(lo)));
  w[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(lo, 1)));
  w[2] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(hi)));
  w[3] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(hi, 1)));
}
template <int G>
inline float group_sum(const float* x) {
  Vec v = load(x);
  for (int i = 16; i < G; i += 16) v = _mm512_add_ps(v, load(x + i));
  return _mm512_reduce_add_ps(v);
}
inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 2); }
constexpr int64_t TILE_TOKENS = 6;       // 24 sums + 2-4 weights + 1-2 broadcasts of 32 registers (the scales
                                         // and minimums load once the group's weights are done)
constexpr int64_t MIN_TILE_TOKENS = 6;
#else   // AVX2 and portable builds: GCC vector types (AVX2 lowers each 16-lane operation to two)
using Vec = trellm::v16;
inline Vec zero() { return Vec{}; }
inline Vec broadcast(float v) { return Vec{} + v; }
inline Vec load(const float* p) { return trellm::load16(p); }
inline Vec madd(Vec a, Vec b, Vec c) { return a * b + c; }
inline Vec nmadd(Vec a, Vec b, Vec c) { return c - a * b; }
inline void store(float* p, Vec v) { trellm::store16(p, v); }
typedef int8_t v16s8 __attribute__((vector_size(16)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));
inline Vec widen_s8(const int8_t* p) {
  v16s8 q;
  std::memcpy(&q, p, sizeof(q));
  return __builtin_convertvector(__builtin_convertvector(q, trellm::vi16), Vec);
}
inline Vec widen_u8(v16u8 q) { return __builtin_convertvector(__builtin_convertvector(q, trellm::vi16), Vec); }
inline void widen_nibbles(const uint8_t* p, Vec w[4]) {
  v16u8 a, b;
  std::memcpy(&a, p, sizeof(a));
  std::memcpy(&b, p + 16, sizeof(b));
  w[0] = widen_u8(a & 15);
  w[1] = widen_u8(b & 15);
  w[2] = widen_u8(a >> 4);
  w[3] = widen_u8(b >> 4);
}
template <int G>
inline float group_sum(const float* x) {
  Vec v = load(x);
  for (int i = 16; i < G; i += 16) v += load(x + i);
  float total = 0;
  for (int i = 0; i < 16; ++i) total += v[i];
  return total;
}
inline void prefetch(const void*) {}
constexpr int64_t TILE_TOKENS = 4;
constexpr int64_t MIN_TILE_TOKENS = 4;
#endif

// The group's sums scaled into the totals, and with minimums each token's group sum of x (`sums`, a row of K/G per
// token, summed once per call) times the minimum taken off.
template <int G, bool MIN, int MT>
inline void finish_group(const Vec* part0, const Vec* part1, Vec* acc0, Vec* acc1, const float* s,
                         trellm::blocked_linear::Rows<float> rows, int64_t k0) {
  const Vec s0 = load(s), s1 = load(s + 16);
  for (int m = 0; m < MT; ++m) {
    acc0[m] = madd(part0[m], s0, acc0[m]);
    acc1[m] = madd(part1[m], s1, acc1[m]);
  }
  if constexpr (MIN) {
    const Vec n0 = load(s + BLOCK), n1 = load(s + BLOCK + 16);
    for (int m = 0; m < MT; ++m) {
      const Vec xs = broadcast(rows.scales[m * rows.ld_scales + k0 / G]);
      acc0[m] = nmadd(xs, n0, acc0[m]);
      acc1[m] = nmadd(xs, n1, acc1[m]);
    }
  }
}

template <int MT>
inline void store_rows(const Vec* acc0, const Vec* acc1, float* y, int64_t N) {
  for (int m = 0; m < MT; ++m) {
    store(y + m * N, acc0[m]);
    store(y + m * N + 16, acc1[m]);
  }
}

// int8 q: per input, the block's 32 weights widened from memory into two 16-lane vectors.
template <int G, bool MIN, int MT>
inline void int8_tile(trellm::blocked_linear::Rows<float> rows, int64_t K, const int8_t* blk, const int8_t* next,
                      const float* s, float* y, int64_t N) {
  const float* x = rows.x;
  Vec acc0[MT], acc1[MT];
  for (int m = 0; m < MT; ++m) acc0[m] = acc1[m] = zero();
  const int8_t* ahead = next != nullptr ? next : blk;   // unconditionally, as cpu/bf16_linear.cpp says why
  for (int64_t k0 = 0; k0 < K; k0 += G, s += (MIN ? 2 : 1) * BLOCK) {
    Vec part0[MT], part1[MT];
    for (int m = 0; m < MT; ++m) part0[m] = part1[m] = zero();
    for (int64_t k = k0; k < k0 + G; ++k) {
      const int8_t* wk = blk + k * BLOCK;
      prefetch(ahead + k * BLOCK);
      const Vec w0 = widen_s8(wk), w1 = widen_s8(wk + 16);
      for (int m = 0; m < MT; ++m) {
        const Vec xb = broadcast(x[m * K + k]);
        part0[m] = madd(w0, xb, part0[m]);
        part1[m] = madd(w1, xb, part1[m]);
      }
    }
    finish_group<G, MIN, MT>(part0, part1, acc0, acc1, s, rows, k0);
  }
  store_rows<MT>(acc0, acc1, y, N);
}

// 4-bit q: per pair of inputs, 32 bytes give both inputs' 32 weights.
template <int G, bool MIN, int MT>
inline void nibble_tile(trellm::blocked_linear::Rows<float> rows, int64_t K, const uint8_t* blk,
                        const uint8_t* next, const float* s, float* y, int64_t N) {
  const float* x = rows.x;
  Vec acc0[MT], acc1[MT];
  for (int m = 0; m < MT; ++m) acc0[m] = acc1[m] = zero();
  const uint8_t* ahead = next != nullptr ? next : blk;
  for (int64_t k0 = 0; k0 < K; k0 += G, s += (MIN ? 2 : 1) * BLOCK) {
    Vec part0[MT], part1[MT];
    for (int m = 0; m < MT; ++m) part0[m] = part1[m] = zero();
    for (int64_t k = k0; k < k0 + G; k += 2) {
      const uint8_t* wk = blk + k / 2 * BLOCK;
      prefetch(ahead + k / 2 * BLOCK);
      Vec w[4];
      widen_nibbles(wk, w);
      for (int m = 0; m < MT; ++m) {
        const Vec xa = broadcast(x[m * K + k]), xb = broadcast(x[m * K + k + 1]);
        part0[m] = madd(w[2], xb, madd(w[0], xa, part0[m]));
        part1[m] = madd(w[3], xb, madd(w[1], xa, part1[m]));
      }
    }
    finish_group<G, MIN, MT>(part0, part1, acc0, acc1, s, rows, k0);
  }
  store_rows<MT>(acc0, acc1, y, N);
}

// The driver's kernel: int8 weights, or uint8 bytes holding two 4-bit ones.
template <class W, int G, bool MIN>
struct GroupKernel {
  static constexpr bool NIBBLES = std::is_same_v<W, uint8_t>;
  using Weight = W;
  using Input = float;
  static constexpr int64_t K_ALIGN = 1;
  static constexpr int64_t K_GROUP = 1;
  static constexpr int64_t WEIGHTS_PER_ELEMENT = NIBBLES ? 2 : 1;
  static constexpr int64_t MT_MAX = MIN ? MIN_TILE_TOKENS : TILE_TOKENS;
  static int64_t epilogue_stride(int64_t K) { return K / G * (MIN ? 2 : 1) * BLOCK; }

  template <int MT>
  static void tile(trellm::blocked_linear::Rows<float> rows, int64_t K, const W* blk, const W* next,
                   const float* scales, float* y, int64_t N) {
    if constexpr (NIBBLES)
      nibble_tile<G, MIN, MT>(rows, K, blk, next, scales, y, N);
    else
      int8_tile<G, MIN, MT>(rows, K, blk, next, scales, y, N);
  }
};

// Each row's sum over each group of G inputs [M, K/G], in one fixed order (group_sum), once per call.
template <int G>
at::Tensor group_sums(at::Tensor x) {
  const int64_t M = x.size(0), K = x.size(1);
  auto sums = at::empty({M, K / G}, x.options());
  const float* xp = x.data_ptr<float>();
  float* sp = sums.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t g = 0; g < K / G; ++g) sp[m * (K / G) + g] = group_sum<G>(xp + m * K + g * G);
  });
  return sums;
}

template <class W, int G>
void run_group(at::Tensor y, at::Tensor x, at::Tensor packed, at::Tensor scales) {
  const float* s = scales.data_ptr<float>();
  if (scales.size(2) == 2) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(1) % G == 0,
                "group_linear: x must be contiguous float32 [M, K]");
    const at::Tensor sums = group_sums<G>(x);
    trellm::blocked_linear::run<GroupKernel<W, G, true>>("group_linear", y, x, sums.data_ptr<float>(), packed, s,
                                                         sums.size(1));
  } else {
    trellm::blocked_linear::run<GroupKernel<W, G, false>>("group_linear", y, x, nullptr, packed, s);
  }
}

template <class W>
void run_any_group(at::Tensor y, at::Tensor x, at::Tensor packed, at::Tensor scales, int64_t group) {
  switch (group) {
    case 16: return run_group<W, 16>(y, x, packed, scales);
    case 32: return run_group<W, 32>(y, x, packed, scales);
    case 64: return run_group<W, 64>(y, x, packed, scales);
    default: return run_group<W, 128>(y, x, packed, scales);
  }
}

}  // namespace

void group_linear_cpu(at::Tensor y, at::Tensor x, at::Tensor packed, at::Tensor scales, int64_t group) {
  const bool nibbles = packed.scalar_type() == at::kByte;
  TORCH_CHECK(nibbles || packed.scalar_type() == at::kChar, "group_linear: int8 weights, or uint8 holding 4-bit ones");
  TORCH_CHECK(group == 16 || group == 32 || group == 64 || group == 128,
              "group_linear: groups of 16, 32, 64 or 128 inputs, not ", group);
  const int64_t K = packed.size(1) * (nibbles ? 2 : 1);
  TORCH_CHECK(packed.dim() == 3 && K % group == 0, "group_linear: K must be whole groups");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 4 &&
              scales.size(0) == packed.size(0) && scales.size(1) == K / group &&
              (scales.size(2) == 1 || scales.size(2) == 2) && scales.size(3) == BLOCK,
              "group_linear: float32 scales (and minimums) packed [N/32, K/", group, ", 1 or 2, 32]");
  if (nibbles)
    run_any_group<uint8_t>(y, x, packed, scales, group);
  else
    run_any_group<int8_t>(y, x, packed, scales, group);
}
