// bf16 linear on CPUs with AVX512-BF16 dot products: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), x and w bf16,
// y float32; the driver is cpu/blocked_linear.h.
//
// Why: in a decode step a few dozen tokens meet every weight of the model, and the weights come from memory. oneDNN's
// bf16 GEMM, fast on weights already in cache, does not overlap those reads with its arithmetic for a few dozen tokens
// (perf/RESULTS.md has the rates, cold and hot). Here, as in cpu/fp32_linear.cpp, the next block's weights are
// prefetched while the current block's products run, and each product is one VDPBF16PS: 16 outputs times a pair of
// k, summed into float32. For that the weight is packed at load in k-pairs, [N/32, K/2, 32, 2] (kernels/linear.py,
// pack_pairs): one 64-byte load holds 16 outputs' pairs, and a token's pair x[m, k], x[m, k + 1] is one 32-bit
// broadcast. K must be even.
#include "blocked_linear.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <cstring>

namespace {

using trellm::blocked_linear::BLOCK;
using bf16 = c10::BFloat16;

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

struct Bf16PairKernel {
  using Weight = bf16;
  using Input = bf16;
  static constexpr int64_t K_ALIGN = 2;
  static constexpr int64_t K_GROUP = 2;   // k values side by side per output in the packed weight
  static constexpr int64_t MT_MAX = trellm::blocked_linear::MT_REGISTERS;

  template <int MT>
  static void tile(trellm::blocked_linear::Rows<bf16> rows, int64_t K, const bf16* blk, const bf16* next,
                   const float* bias, float* y, int64_t N) {
    __m512 acc0[MT], acc1[MT];
    for (int m = 0; m < MT; ++m) acc0[m] = acc1[m] = _mm512_setzero_ps();
    // Prefetched unconditionally (this block again when there is no next one, a cache hit): with a branch on `next`
    // or _mm_prefetch inside the loop, GCC 12 kept the accumulators in memory as well as in registers.
    const bf16* ahead = next != nullptr ? next : blk;
    for (int64_t k = 0; k < K; k += 2) {
      const bf16* wk = blk + k * BLOCK;   // the pair's 32 x 2 values: 128 bytes, two cache lines
      __builtin_prefetch(ahead + k * BLOCK, 0, 2);
      __builtin_prefetch(ahead + k * BLOCK + 32, 0, 2);
      const __m512bh w0 = as_bh(_mm512_loadu_si512(wk)), w1 = as_bh(_mm512_loadu_si512(wk + 32));
      for (int m = 0; m < MT; ++m) {
        int32_t pair;
        std::memcpy(&pair, rows.x + m * rows.ldx + k, sizeof(pair));
        const __m512bh xb = as_bh(_mm512_set1_epi32(pair));
        acc0[m] = _mm512_dpbf16_ps(acc0[m], xb, w0);
        acc1[m] = _mm512_dpbf16_ps(acc1[m], xb, w1);
      }
    }
    trellm::blocked_linear::store_tile<MT>(acc0, acc1, bias, y, N);
  }
};

}  // namespace

void bf16_linear_cpu(at::Tensor y, at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias) {
  const float* bp = trellm::blocked_linear::bias_data(bias, packed, "bf16_linear");
  trellm::blocked_linear::run<Bf16PairKernel>("bf16_linear", y, x, nullptr, packed, bp);
}
#else
void bf16_linear_cpu(at::Tensor, at::Tensor, at::Tensor, c10::optional<at::Tensor>) {
  TORCH_CHECK(false, "bf16_linear: built without AVX512-BF16 (kernels/linear_choice.py does not offer it here)");
}
#endif
