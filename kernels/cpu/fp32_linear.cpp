// Float32 linear on AVX-512 CPUs: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]); the driver is cpu/blocked_linear.h.
//
// Why: a decode step multiplies a few dozen tokens by every weight of the model, and the weights (4 bytes each) come
// from memory, not cache, every step. oneDNN's fp32 matmul read them far below the machine's bandwidth for a few tokens
// and did not overlap the reads with its arithmetic for a few dozen (perf/RESULTS.md has the rates). Here the next
// block's weights are prefetched while the current block's products run, so the memory stream and the FMAs overlap.
// The tile: for each k the block's 32 weights are two 16-lane loads, multiplied by each token's x[m, k] broadcast
// (an outer product, a GEMM micro-kernel's shape).
#include "blocked_linear.h"

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

using trellm::blocked_linear::BLOCK;

struct Fp32Kernel {
  using Weight = float;
  using Input = float;
  static constexpr int64_t K_ALIGN = 1;
  static constexpr int64_t K_GROUP = 1;
  static constexpr int64_t MT_MAX = trellm::blocked_linear::MT_REGISTERS;

  template <int MT>
  static void tile(trellm::blocked_linear::Rows<float> rows, int64_t K, const float* blk, const float* next,
                   const float* bias, float* y, int64_t N) {
    __m512 acc0[MT], acc1[MT];
    for (int m = 0; m < MT; ++m) acc0[m] = acc1[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
      if (next != nullptr) {
        _mm_prefetch(reinterpret_cast<const char*>(next + k * BLOCK), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(next + k * BLOCK + 16), _MM_HINT_T1);
      }
      const __m512 w0 = _mm512_loadu_ps(blk + k * BLOCK), w1 = _mm512_loadu_ps(blk + k * BLOCK + 16);
      for (int m = 0; m < MT; ++m) {
        const __m512 xb = _mm512_set1_ps(rows.x[m * rows.ldx + k]);
        acc0[m] = _mm512_fmadd_ps(w0, xb, acc0[m]);
        acc1[m] = _mm512_fmadd_ps(w1, xb, acc1[m]);
      }
    }
    trellm::blocked_linear::store_tile<MT>(acc0, acc1, bias, y, N);
  }
};

}  // namespace

void fp32_linear_cpu(at::Tensor y, at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias) {
  const float* bp = trellm::blocked_linear::bias_data(bias, packed, "fp32_linear");
  trellm::blocked_linear::run<Fp32Kernel>("fp32_linear", y, x, nullptr, packed, bp);
}
#else
void fp32_linear_cpu(at::Tensor, at::Tensor, at::Tensor, c10::optional<at::Tensor>) {
  TORCH_CHECK(false, "fp32_linear: built without AVX-512 (kernels/linear.py keeps oneDNN there)");
}
#endif
