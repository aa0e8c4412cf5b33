// Small math shared by the CPU operators.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace trellm {

// 2^f for f in [-0.5, 0.5]: the degree-6 Taylor polynomial of exp_approx and exp16, for a float or 16 lanes.
template <typename T>
inline T exp2_fraction(T f) {
  T p = T{} + 1.5403530393381606e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  return p * f + 1.0f;
}

// exp(x) for x <= 88: 2^(x log2 e) split into an integer power, set in the exponent bits, and a degree-6 Taylor
// polynomial for the fraction (relative error below 2e-7, about one float ulp). Plain arithmetic, so `omp simd`
// loops over it vectorize; std::exp would leave them scalar.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float t = x * 1.4426950408889634f;
  const float fi = std::floor(t + 0.5f);  // f in [-0.5, 0.5): the Taylor terms below suffice there
  const float p = exp2_fraction(t - fi);
  int32_t bits = (static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

template <typename T>
inline float f32(T v) { return static_cast<float>(v); }

// bf16 both ways as c10 converts (float -> bf16 rounds to nearest even, NaN becomes 0x7FC0), written without a
// branch: c10::BFloat16's constructor tests isnan first, which kept the operators' `omp simd` loops scalar for bf16
// (3-4x the float32 time for half the bytes).
template <>
inline float f32<c10::BFloat16>(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename scalar_t>
inline scalar_t round_to(float v) { return static_cast<scalar_t>(v); }

template <>
inline c10::BFloat16 round_to<c10::BFloat16>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>(v != v ? 0x7FC0u : rounded), c10::BFloat16::from_bits());
}

// An FP8 e4m3 (float8_e4m3fn) value of the KV cache, as its byte. The conversion to float is integer arithmetic
// and selects (no table, no denormal float), so `omp simd` loops and load16 below vectorize it.
struct fp8_e4m3 {
  uint8_t bits;
  operator float() const {
    const int32_t b = bits, e = (b >> 3) & 15, m = b & 7;
    const int32_t normal_bits = ((e + 120) << 23) | (m << 20);
    float normal;
    std::memcpy(&normal, &normal_bits, sizeof(normal));
    const float mag = e == 0 ? static_cast<float>(m) * 0.001953125f : normal;
    return b & 0x80 ? -mag : mag;
  }
};

// float -> float8_e4m3fn bits for |y| <= 448, rounding half to even: torch's cast, bit for bit.
inline uint8_t fp8_e4m3_bits(float y) {
  int32_t ybits;
  std::memcpy(&ybits, &y, sizeof(ybits));
  const float a = std::fabs(y);
  int32_t bits;
  std::memcpy(&bits, &a, sizeof(bits));
  int32_t code;
  if (a < 0.015625f) {
    code = static_cast<int32_t>(std::nearbyint(a * 512.0f));   // subnormals: multiples of 2^-9
  } else {
    const int32_t r = (bits + 0x7FFFF + ((bits >> 20) & 1)) & ~0xFFFFF;
    code = (((r >> 23) - 120) << 3) | ((r >> 20) & 7);
  }
  return static_cast<uint8_t>(ybits < 0 ? code | 0x80 : code);
}

// 16 floats as one value: GCC and Clang map it onto AVX-512 registers (two AVX2 ones elsewhere), so the loops
// below keep their running sums in registers instead of reloading them from memory on every step.
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));

#if defined(__clang__)
#define TRELLM_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define TRELLM_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, vi16{__VA_ARGS__})
#endif

template <typename T>
inline v16 load16(const T* p) {
  v16 r;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(&r, p, sizeof(r));
  } else {
    for (int i = 0; i < 16; ++i) r[i] = static_cast<float>(p[i]);
  }
  return r;
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
// 16 FP8 e4m3 values as float16 bits of the value / 2^8: e4m3's exponent and mantissa moved into a float16's
// (bias 15 instead of 7, subnormals included, which the hardware conversion handles), the sign into the float16's.
// The caller converts them and multiplies by 2^8.
inline __m256i e4m3_half_bits(const fp8_e4m3* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7),
                         _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
}
#endif

// 16 KV-cache bytes as floats. GCC leaves the generic loop above scalar for 1-byte types (as it did for the INT8
// linear operator), so AVX-512 widens them here: INT8 sign-extends and converts; FP8 e4m3 goes through float16.
#if defined(__AVX512F__)
inline v16 load16(const int8_t* p) {
  const __m512 r = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  v16 out;
  std::memcpy(&out, &r, sizeof(out));
  return out;
}

inline v16 load16(const fp8_e4m3* p) {
  const __m512 r = _mm512_mul_ps(_mm512_cvtph_ps(e4m3_half_bits(p)), _mm512_set1_ps(256.f));
  v16 out;
  std::memcpy(&out, &r, sizeof(out));
  return out;
}

// bfloat16 and float16 (a bf16/fp16 model's KV cache and activations) widened 16 at a time: bf16's bits are a
// float's upper half (a zero-extension and a shift); float16 takes the hardware conversion. The generic loop above
// converted them one by one, which kept bf16 decode attention slower than fp32's on AVX-512 hosts though it reads
// half the bytes.
inline v16 load16(const c10::BFloat16* p) {
  const __m512 r = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  v16 out;
  std::memcpy(&out, &r, sizeof(out));
  return out;
}

inline v16 load16(const c10::Half* p) {
  const __m512 r = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  v16 out;
  std::memcpy(&out, &r, sizeof(out));
  return out;
}
#endif

inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

// exp_approx on 16 lanes: the same clamp and polynomial, the power of two found by adding and subtracting 1.5 * 2^23
// (nearest, ties to even, where exp_approx's floor(t + 0.5) rounds ties up: either leaves f within [-0.5, 0.5]).
// GCC keeps exp_approx's loops scalar on AVX-512 builds, which left SiLU-and-mul well behind torch's silu * up.
inline v16 exp16(v16 x) {
  x = x < -87.0f ? v16{} - 87.0f : x;
  x = x > 88.0f ? v16{} + 88.0f : x;
  const v16 t = x * 1.4426950408889634f;
  const v16 fi = (t + 12582912.0f) - 12582912.0f;
  const v16 p = exp2_fraction(t - fi);
  const vi16 bits = (__builtin_convertvector(fi, vi16) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// 16 floats rounded to bf16 or fp16 and stored, as round_to rounds each (bf16: nearest even, NaN 0x7FC0; fp16: the
// hardware's nearest even), in vector instructions where the build has them; element by element otherwise.
template <typename T>
inline void store16(T* p, v16 v) {
  for (int i = 0; i < 16; ++i) p[i] = round_to<T>(v[i]);
}

#if defined(__AVX512F__)
inline void store16(c10::BFloat16* p, v16 v) {
  __m512 f;
  std::memcpy(&f, &v, sizeof(f));
  const __m512i u = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

inline void store16(c10::Half* p, v16 v) {
  __m512 f;
  std::memcpy(&f, &v, sizeof(f));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT));
}
#elif defined(__AVX2__) && defined(__F16C__)
inline __m256i bf16_bits8(__m256 f) {   // 8 floats' bf16 bits, nearest even, NaN 0x7FC0, in 32-bit lanes
  const __m256i u = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
}

inline void store16(c10::BFloat16* p, v16 v) {
  __m256 h[2];
  std::memcpy(h, &v, sizeof(h));
  // packus interleaves the two inputs' 128-bit halves; the permute puts the 16 values back in order.
  const __m256i packed = _mm256_packus_epi32(bf16_bits8(h[0]), bf16_bits8(h[1]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
}

inline void store16(c10::Half* p, v16 v) {
  __m256 h[2];
  std::memcpy(h, &v, sizeof(h));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(h[0], _MM_FROUND_TO_NEAREST_INT));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(h[1], _MM_FROUND_TO_NEAREST_INT));
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2 without AVX-512 (Zen 3, Zen 2, many Intel servers): GCC lowers the 16-lane type above badly there (scalar
// times vector stores the scalar 16 times; running sums go through the stack and general registers), so the hot
// loops use two 8-float registers, loaded from the cache's type by these. Decode attention on a Zen 3 got several
// times faster (perf/RESULTS.md, section "What changed: the C++ attention on AVX2").
#define TRELLM_AVX2 1
inline void load8x2(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}

inline void load8x2(const int8_t* p, __m256& lo, __m256& hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}

inline void load8x2(const fp8_e4m3* p, __m256& lo, __m256& hi) {
  const __m256i h = e4m3_half_bits(p);
  const __m256 k = _mm256_set1_ps(256.f);
  lo = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), k);
  hi = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), k);
}

// bfloat16 (a bf16 model's KV cache): its bits are a float's upper half, so widening is a zero-extension and a
// shift, 8 values per instruction; converted one by one into a stack array, bf16 decode attention was slower than
// fp32's though it reads half the bytes.
inline void load8x2(const c10::BFloat16* p, __m256& lo, __m256& hi) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(b)), 16));
  hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(b, 1)), 16));
}

// float16: F16C's conversion.
inline void load8x2(const c10::Half* p, __m256& lo, __m256& hi) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(b));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(b, 1));
}

template <typename T>   // double (the operators' dispatch compiles it; nothing serves it): one by one
inline void load8x2(const T* p, __m256& lo, __m256& hi) {
  alignas(32) float f[16];
  for (int i = 0; i < 16; ++i) f[i] = static_cast<float>(p[i]);
  lo = _mm256_load_ps(f);
  hi = _mm256_load_ps(f + 8);
}
#endif

#if defined(TRELLM_AVX2)
// The lane sums of 8 vectors of 8 floats, as one: two rounds of horizontal adds, then the 128-bit halves put
// together (hadd works within each half).
inline __m256 sum_lanes_8x8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}
#endif

// out[j] = the sum of the 16 lanes of p[j], for 16 vectors at once: a tree of pairwise shuffles and adds (15
// steps for 16 sums) instead of a horizontal reduction per vector. With AVX2 only, each vector's halves are
// folded first and 8 are summed at a time with horizontal adds (GCC splits the 16-lane shuffles through the stack).
inline v16 sum_lanes_16(const v16* p) {
#if defined(TRELLM_AVX2)
  __m256 f[16];
  for (int j = 0; j < 16; ++j) {
    __m256 h[2];
    std::memcpy(h, &p[j], sizeof(h));
    f[j] = _mm256_add_ps(h[0], h[1]);
  }
  __m256 out[2] = {sum_lanes_8x8(f), sum_lanes_8x8(f + 8)};
  v16 r;
  std::memcpy(&r, out, sizeof(r));
  return r;
#else
  v16 q[8], r[4], u[2];
  for (int i = 0; i < 8; ++i)   // lanes 2k+c of q[i]: half-sums of p[2i+c]
    q[i] = TRELLM_SHUFFLE(p[2 * i], p[2 * i + 1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
           TRELLM_SHUFFLE(p[2 * i], p[2 * i + 1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  for (int i = 0; i < 4; ++i)   // lanes 4k+c of r[i]: quarter-sums of p[4i+c]
    r[i] = TRELLM_SHUFFLE(q[2 * i], q[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           TRELLM_SHUFFLE(q[2 * i], q[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  for (int i = 0; i < 2; ++i)   // lanes 8k+c of u[i]: eighth-sums of p[8i+c]
    u[i] = TRELLM_SHUFFLE(r[2 * i], r[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           TRELLM_SHUFFLE(r[2 * i], r[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  return TRELLM_SHUFFLE(u[0], u[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         TRELLM_SHUFFLE(u[0], u[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
#endif
}

// v rounded to scalar_t and widened back (the rounding an intermediate of that dtype gets), 16 lanes at a time.
template <typename scalar_t>
inline v16 rounded16(v16 v) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return v;
  } else {
    alignas(64) scalar_t tmp[16];
    store16(tmp, v);
    return load16(tmp);
  }
}

}  // namespace trellm
