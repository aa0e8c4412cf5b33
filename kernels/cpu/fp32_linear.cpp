// Float32 linear on AVX-512 CPUs: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]).
//
// Why: a decode step multiplies a few dozen tokens by every weight of the model, and the weights (4 bytes each) come
// from memory, not cache, every step. oneDNN's fp32 matmul ran those shapes at 7-120 GFLOPS on a 2-core Zen 4, where
// its large-M rate is ~200: at 1-8 tokens it read the weights at half the machine's bandwidth, and at 16-48 it did
// not overlap the reads with its arithmetic. Here the next block's weights are prefetched while the current block's
// products run, so the memory stream and the FMAs overlap: on the anchor model's 41 matrices (perf/RESULTS.md),
// 1.9x oneDNN at 1 token, 2.1x at 8, 1.3x at 26, 1.2x at 48, level from 128 tokens up (prefill chunks).
// Layout: packed at load (kernels/linear.py) into blocks of 32 outputs, [N/32][K][32] float, as cpu/int8_linear.cpp
// packs its int8 weights: for each k the block's 32 weights are two 16-lane loads, multiplied by each token's x[m, k]
// broadcast (an outer product, a GEMM micro-kernel's shape). A tile holds up to 12 tokens (24 accumulators); the
// rows of a call are split into tiles of nearly equal size, so 26 tokens make tiles of 9, 9 and 8, not 12, 12, 2.
// Each y[m, n] is summed over k in order in one lane whatever the tile, so a token's result does not depend on
// what else is in the batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int64_t BLOCK = 32;     // outputs per packed block
constexpr int64_t MT_MAX = 12;    // tokens per tile: 24 accumulators + 2 weight vectors in 32 registers
constexpr int64_t M_CHUNK = 96;   // tokens whose x rows stay in L2 while the thread's blocks pass over them

// Rows [0, MT) of x times one block. `next` (or null): the next block's weights, prefetched into L2 meanwhile.
template <int MT>
void tile(const float* x, int64_t K, const float* blk, const float* next, const float* bias, float* y, int64_t N) {
  __m512 acc0[MT], acc1[MT];
  for (int m = 0; m < MT; ++m) acc0[m] = acc1[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if (next != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(next + k * BLOCK), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next + k * BLOCK + 16), _MM_HINT_T1);
    }
    const __m512 w0 = _mm512_loadu_ps(blk + k * BLOCK), w1 = _mm512_loadu_ps(blk + k * BLOCK + 16);
    for (int m = 0; m < MT; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * K + k]);
      acc0[m] = _mm512_fmadd_ps(w0, xb, acc0[m]);
      acc1[m] = _mm512_fmadd_ps(w1, xb, acc1[m]);
    }
  }
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  for (int m = 0; m < MT; ++m) {
    _mm512_storeu_ps(y + m * N, bias ? _mm512_add_ps(acc0[m], b0) : acc0[m]);
    _mm512_storeu_ps(y + m * N + 16, bias ? _mm512_add_ps(acc1[m], b1) : acc1[m]);
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, const float*, const float*, float*, int64_t);
constexpr TileFn kTiles[MT_MAX] = {tile<1>, tile<2>, tile<3>, tile<4>,  tile<5>,  tile<6>,
                                   tile<7>, tile<8>, tile<9>, tile<10>, tile<11>, tile<12>};

// Rows [m0, m1) of one block, in tiles of nearly equal size; the first tile prefetches `next`.
inline void block_rows(const float* x, int64_t K, const float* blk, const float* next, const float* bias, float* y,
                       int64_t N, int64_t m0, int64_t m1) {
  const int64_t tiles = (m1 - m0 + MT_MAX - 1) / MT_MAX;
  int64_t m = m0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t mt = (m1 - m + (tiles - t) - 1) / (tiles - t);
    kTiles[mt - 1](x + m * K, K, blk, t == 0 ? next : nullptr, bias, y + m * N, N);
    m += mt;
  }
}

}  // namespace

void fp32_linear_cpu(torch::Tensor y, torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && y.scalar_type() == torch::kFloat32 &&
              packed.scalar_type() == torch::kFloat32, "fp32_linear: float32 x, y and weight");
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && packed.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), N = NB * BLOCK;
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == K && packed.size(2) == BLOCK,
              "fp32_linear: the weight must be packed [N/32, K, 32]");
  TORCH_CHECK(y.size(0) == M && y.size(1) == N);
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N);
    bp = bias->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  const float* w = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t m0 = 0; m0 < M; m0 += M_CHUNK) {
      const int64_t m1 = std::min(M, m0 + M_CHUNK);
      for (int64_t b = b0; b < b1; ++b) {
        // The first pass over the thread's blocks reads them from memory: fetch the next while this one multiplies.
        const float* next = m0 == 0 && b + 1 < b1 ? w + (b + 1) * K * BLOCK : nullptr;
        block_rows(xp, K, w + b * K * BLOCK, next, bp ? bp + b * BLOCK : nullptr, yp + b * BLOCK, N, m0, m1);
      }
    }
  });
}
#else
void fp32_linear_cpu(torch::Tensor, torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "fp32_linear: built without AVX-512 (kernels/linear.py keeps oneDNN there)");
}
#endif
