// The one driver of the linear operators (cpu/fp32_linear.cpp, half_linear.cpp, bf16_linear.cpp, int8_linear.cpp,
// group_linear.cpp):
// y[m, n] = epilogue of sum_k x[m, k] * w[n, k], with the weight packed at load (kernels/linear.py) into blocks of
// BLOCK outputs, [N/BLOCK][K][BLOCK], or for a kernel whose `K_GROUP` is G > 1 (dot products of G values of k at
// once), [N/BLOCK][K/G][BLOCK][G]. Here, once for every weight type: the checks, the split of the blocks over
// torch's threads, the chunks of M_CHUNK tokens whose x rows stay in L2 while a thread's blocks pass over them, and
// the split of each block's rows into tiles of nearly equal size (26 tokens make tiles of 9, 9 and 8, not 12, 12
// and 2). A weight type brings only its tile: `Kernel::tile<MT>(rows, K, blk, next, epilogue, y, N)` computes rows
// [0, MT) of x times one block (`next`: the block that follows, to prefetch, or null; `epilogue`: the block's bias
// or scales, or null; scales per group of inputs for a kernel with `epilogue_stride`), for MT up to its
// `Kernel::MT_MAX`. x is float32 (bf16 for the bf16 operator), or for a
// kernel whose `Input` is int16 the activations quantized per row (`Rows::scales`; each row padded with a zero to an
// even length, `Kernel::K_ALIGN`).
// Each y[m, n] is summed over k in order in one lane whatever the tile, so a token's result does not depend on what
// else is in the batch.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <array>
#include <type_traits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <utility>

namespace trellm::blocked_linear {

constexpr int64_t BLOCK = 32;     // outputs per packed block (kernels/linear.py's CPU_BLOCK; tests check both)
constexpr int64_t MT_REGISTERS = 12;  // tokens per tile held in registers: 24 accumulators + 2 weights in 32 AVX-512
constexpr int64_t M_CHUNK = 96;   // tokens whose x rows stay in L2 while the thread's blocks pass over them

// A tile's rows of x: the first row, the row stride, and each row's scale (null for float32 rows), or a row of
// `ld_scales` values per row of x (group_linear.cpp: each group's sum of the row).
template <class In>
struct Rows {
  const In* x;
  int64_t ldx;
  const float* scales;
  int64_t ld_scales = 1;
  Rows at(int64_t m) const {
    return {x + m * ldx, ldx, scales != nullptr ? scales + m * ld_scales : nullptr, ld_scales};
  }
};

// The float32 bias of the packed weight's N outputs, or null without one.
inline const float* bias_data(const c10::optional<at::Tensor>& bias, const at::Tensor& packed, const char* name) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == packed.size(0) * BLOCK,
              name, ": a float32 bias of N values");
  return bias->data_ptr<float>();
}

#if defined(__AVX512F__)
// An AVX-512 tile's result: rows [0, MT) of its 32 outputs, as two 16-lane sums each, plus the bias where given.
template <int MT>
inline void store_tile(const __m512* acc0, const __m512* acc1, const float* bias, float* y, int64_t N) {
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  for (int m = 0; m < MT; ++m) {
    _mm512_storeu_ps(y + m * N, bias ? _mm512_add_ps(acc0[m], b0) : acc0[m]);
    _mm512_storeu_ps(y + m * N + 16, bias ? _mm512_add_ps(acc1[m], b1) : acc1[m]);
  }
}
#endif

// Floats of `epilogue` per block: BLOCK (one bias or scale per output), or what a kernel whose epilogue is larger
// (one scale per output and group of inputs) says through `Kernel::epilogue_stride(K)`.
template <class Kernel, class = void>
struct EpilogueStride {
  static int64_t of(int64_t) { return BLOCK; }
};
template <class Kernel>
struct EpilogueStride<Kernel, std::void_t<decltype(Kernel::epilogue_stride(int64_t{}))>> {
  static int64_t of(int64_t K) { return Kernel::epilogue_stride(K); }
};

// Weights per element of the packed tensor: 1, or 2 for a kernel whose `WEIGHTS_PER_ELEMENT` says so (4-bit
// weights, two inputs' values in one byte: [N/BLOCK][K/2][BLOCK] bytes).
template <class Kernel, class = void>
struct WeightsPerElement {
  static constexpr int64_t value = 1;
};
template <class Kernel>
struct WeightsPerElement<Kernel, std::void_t<decltype(Kernel::WEIGHTS_PER_ELEMENT)>> {
  static constexpr int64_t value = Kernel::WEIGHTS_PER_ELEMENT;
};

template <class Kernel>
using TileFn = void (*)(Rows<typename Kernel::Input>, int64_t, const typename Kernel::Weight*,
                        const typename Kernel::Weight*, const float*, float*, int64_t);

template <class Kernel, size_t... I>
constexpr std::array<TileFn<Kernel>, sizeof...(I)> tile_table(std::index_sequence<I...>) {
  return {&Kernel::template tile<int(I) + 1>...};
}

// y = x times the packed weight, through Kernel's tiles; `epilogue` (or null): N floats, the bias or the scales;
// `x_scales`: one per row of x when x is quantized (Kernel::Input int16), or `ld_x_scales` per row, else null.
template <class Kernel>
void run(const char* name, at::Tensor y, at::Tensor x, const float* x_scales, at::Tensor packed,
         const float* epilogue, int64_t ld_x_scales = 1) {
  using W = typename Kernel::Weight;
  using In = typename Kernel::Input;
  TORCH_CHECK(x.scalar_type() == c10::CppTypeToScalarType<In>::value && y.scalar_type() == at::kFloat, name,
              ": x must be ", c10::CppTypeToScalarType<In>::value, " and y float32");
  TORCH_CHECK(packed.scalar_type() == c10::CppTypeToScalarType<W>::value, name, ": the weight is ",
              packed.scalar_type(), ", expected ", c10::CppTypeToScalarType<W>::value);
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && packed.is_contiguous(), name, ": contiguous tensors");
  constexpr int64_t G = Kernel::K_GROUP;
  TORCH_CHECK(packed.dim() == (G == 1 ? 3 : 4) && packed.size(2) == BLOCK && (G == 1 || packed.size(3) == G), name,
              ": the weight must be packed [N/", BLOCK, ", K", G == 1 ? "" : "/G", ", ", BLOCK,
              G == 1 ? "" : ", G", "]");
  constexpr int64_t PER = WeightsPerElement<Kernel>::value;
  const int64_t M = x.size(0), K = packed.size(1) * G * PER, NB = packed.size(0), N = NB * BLOCK;
  const int64_t block_elements = K * BLOCK / PER;
  const int64_t ldx = (K + Kernel::K_ALIGN - 1) / Kernel::K_ALIGN * Kernel::K_ALIGN;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == ldx, name, ": x must be [M, ", ldx, "] for the weight's K = ", K);
  TORCH_CHECK(y.size(0) == M && y.size(1) == N, name, ": y must be [M, N]");
  constexpr int64_t MT_MAX = Kernel::MT_MAX;
  static constexpr auto tiles = tile_table<Kernel>(std::make_index_sequence<MT_MAX>{});
  const Rows<In> rows{x.data_ptr<In>(), ldx, x_scales, ld_x_scales};
  const W* w = packed.data_ptr<W>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t m0 = 0; m0 < M; m0 += M_CHUNK) {
      const int64_t m1 = std::min(M, m0 + M_CHUNK), num_tiles = (m1 - m0 + MT_MAX - 1) / MT_MAX;
      for (int64_t b = b0; b < b1; ++b) {
        const W* blk = w + b * block_elements;
        // The first pass over the thread's blocks reads them from memory: the next one may be fetched meanwhile.
        const W* next = m0 == 0 && b + 1 < b1 ? blk + block_elements : nullptr;
        const float* epi = epilogue != nullptr ? epilogue + b * EpilogueStride<Kernel>::of(K) : nullptr;
        for (int64_t t = 0, m = m0; t < num_tiles; ++t) {
          const int64_t mt = (m1 - m + (num_tiles - t) - 1) / (num_tiles - t);
          tiles[mt - 1](rows.at(m), K, blk, t == 0 ? next : nullptr, epi, yp + m * N + b * BLOCK, N);
          m += mt;
        }
      }
    }
  });
}

}  // namespace trellm::blocked_linear
