// bf16 linear on AMX tiles: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), x and w bf16, y float32 or bf16 (the
// float32 sum rounded once), on the weight cpu/bf16_linear.cpp reads.
//
// Why: that k-pair layout, [N/32, K/2, 32, 2], makes one-token calls read memory at speed, but its dot products
// take one 16-lane pair at a time, so a prefill or a 48-user step ran it far below what the AMX units do, and the
// weight was held in oneDNN's layout instead, which is slow at one token. An AMX B tile wants exactly that layout:
// rows of k-pairs, each row 16 outputs times 2 values, 64 bytes. So a block's 32 outputs are two B tiles read in
// place with a row stride of 128 bytes, and one layout serves every token count.
// Each block takes up to 32 tokens at a time (two A tiles of 16 rows, four C tiles of 16 x 16 sums); K must be a
// multiple of 32 (one A tile's width). Sums are float32, over k in tile order, and a token's row depends only on its
// own x, whatever else is in the call.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include "blocked_linear.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <vector>

namespace {

using trellm::blocked_linear::BLOCK;
using bf16 = c10::BFloat16;

constexpr int64_t TILE_ROWS = 16;   // tokens per A tile, and k-pairs per B tile
constexpr int64_t TILE_K = 32;      // k values per A tile row: 64 bytes
constexpr int64_t M_TILE = 2 * TILE_ROWS;

// The tile configuration of `ldtilecfg` (palette 1): for a chunk of `rows0` + `rows1` tokens, tmm0/tmm1 hold x's
// two row groups, tmm2/tmm3 the two halves of a block's outputs, tmm4-7 the sums (row group x half).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig(int rows0, int rows1) {
    const int r[8] = {rows0, rows1, TILE_ROWS, TILE_ROWS, rows0, rows0, rows1, rows1};
    for (int t = 0; t < 8; ++t) {
      rows[t] = static_cast<uint8_t>(r[t]);
      colsb[t] = r[t] > 0 ? 64 : 0;
    }
  }
};

// Linux hands out AMX's tile state only on request, once per process.
bool request_tiles() {
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

// One block's 32 outputs for x's rows [0, rows0 + rows1), into `sums` (a row of 32 floats per token), the tile
// configuration already loaded. `next`: the block to prefetch meanwhile, or null: with few tokens a block takes
// about as long to multiply as to read, and the tile loads alone left memory idle half the time.
template <bool TWO_GROUPS>
inline void block_tile(const bf16* x, int64_t ldx, int64_t K, const bf16* blk, const bf16* next, float* sums) {
  const int64_t x_stride = ldx * sizeof(bf16), w_stride = 2 * BLOCK * sizeof(bf16), s_stride = BLOCK * sizeof(float);
  _tile_zero(4);
  _tile_zero(5);
  if (TWO_GROUPS) {
    _tile_zero(6);
    _tile_zero(7);
  }
  for (int64_t k = 0; k < K; k += TILE_K) {
    const bf16* w = blk + (k / 2) * 2 * BLOCK;   // k-pair k/2's row: 32 outputs x 2 values
    if (next != nullptr)   // the same 2 KiB of the next block: 16 rows of 128 bytes
      for (int64_t line = 0; line < TILE_ROWS * 2 * BLOCK; line += 32)
        __builtin_prefetch(next + k * BLOCK + line, 0, 2);
    _tile_loadd(2, w, w_stride);
    _tile_loadd(3, w + 2 * TILE_ROWS, w_stride);
    _tile_loadd(0, x + k, x_stride);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 3);
    if (TWO_GROUPS) {
      _tile_loadd(1, x + TILE_ROWS * ldx + k, x_stride);
      _tile_dpbf16ps(6, 1, 2);
      _tile_dpbf16ps(7, 1, 3);
    }
  }
  _tile_stored(4, sums, s_stride);
  _tile_stored(5, sums + TILE_ROWS, s_stride);
  if (TWO_GROUPS) {
    _tile_stored(6, sums + TILE_ROWS * BLOCK, s_stride);
    _tile_stored(7, sums + TILE_ROWS * BLOCK + TILE_ROWS, s_stride);
  }
}

}  // namespace

bool bf16_amx_ready() {
  static const bool ready = request_tiles();
  return ready;
}

void bf16_amx_linear_cpu(at::Tensor y, at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(bf16_amx_ready(), "bf16_amx_linear: the kernel refused this process AMX's tile state");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
                  (y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16),
              "bf16_amx_linear: x and the weight bf16, y float32 or bf16");
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && packed.is_contiguous(), "bf16_amx_linear: contiguous tensors");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == BLOCK && packed.size(3) == 2,
              "bf16_amx_linear: the weight must be packed [N/", BLOCK, ", K/2, ", BLOCK, ", 2]");
  const int64_t M = x.size(0), K = packed.size(1) * 2, NB = packed.size(0), N = NB * BLOCK;
  TORCH_CHECK(K % TILE_K == 0, "bf16_amx_linear: K = ", K, " is not a multiple of ", TILE_K);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "bf16_amx_linear: x must be [M, ", K, "]");
  TORCH_CHECK(y.dim() == 2 && y.size(0) == M && y.size(1) == N, "bf16_amx_linear: y must be [M, N]");
  const float* bp = trellm::blocked_linear::bias_data(bias, packed, "bf16_amx_linear");
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* w = packed.data_ptr<bf16>();
  float* yp = y.scalar_type() == at::kFloat ? y.data_ptr<float>() : nullptr;
  bf16* yh = y.scalar_type() == at::kBFloat16 ? y.data_ptr<bf16>() : nullptr;
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    // Each thread loads its own configuration (tile state is per thread): one for the chunks of 32 tokens, and one
    // for a last, shorter chunk, loaded in turn for each block so that the block stays in cache for all its chunks.
    const int64_t full = M / M_TILE * M_TILE, tail = M - full;
    const TileConfig full_config(TILE_ROWS, TILE_ROWS);
    const TileConfig tail_config(static_cast<int>(std::min(tail, TILE_ROWS)),
                                 static_cast<int>(tail - std::min(tail, TILE_ROWS)));
    bool full_loaded = false;
    // The block's sums for every token, 128 bytes a row, then added to the bias into y. (Stored by the tiles straight
    // into y, whose rows lie N floats apart, a tile's 16 rows fell into one L1 set when N was 1024.)
    std::vector<float> sums(M * BLOCK);
    for (int64_t b = b0; b < b1; ++b) {
      const bf16* blk = w + b * K * BLOCK;
      if (full > 0 && !full_loaded) {
        _tile_loadconfig(&full_config);
        full_loaded = true;
      }
      const bf16* next = b + 1 < b1 ? blk + K * BLOCK : nullptr;   // prefetched by the block's first chunk
      for (int64_t m0 = 0; m0 < full; m0 += M_TILE)
        block_tile<true>(xp + m0 * K, K, K, blk, m0 == 0 ? next : nullptr, sums.data() + m0 * BLOCK);
      if (tail > 0) {
        _tile_loadconfig(&tail_config);
        full_loaded = false;
        if (tail > TILE_ROWS)
          block_tile<true>(xp + full * K, K, K, blk, full == 0 ? next : nullptr, sums.data() + full * BLOCK);
        else
          block_tile<false>(xp + full * K, K, K, blk, full == 0 ? next : nullptr, sums.data() + full * BLOCK);
      }
      const __m512 bias0 = bp != nullptr ? _mm512_loadu_ps(bp + b * BLOCK) : _mm512_setzero_ps();
      const __m512 bias1 = bp != nullptr ? _mm512_loadu_ps(bp + b * BLOCK + 16) : _mm512_setzero_ps();
      for (int64_t m = 0; m < M; ++m) {
        const __m512 lo = _mm512_add_ps(_mm512_loadu_ps(sums.data() + m * BLOCK), bias0);
        const __m512 hi = _mm512_add_ps(_mm512_loadu_ps(sums.data() + m * BLOCK + 16), bias1);
        if (yp != nullptr) {
          _mm512_storeu_ps(yp + m * N + b * BLOCK, lo);
          _mm512_storeu_ps(yp + m * N + b * BLOCK + 16, hi);
        } else {   // rounded to nearest even, as torch's .to(bfloat16)
          _mm512_storeu_si512(yh + m * N + b * BLOCK, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
      }
    }
    _tile_release();
  });
}
#else
bool bf16_amx_ready() { return false; }

void bf16_amx_linear_cpu(at::Tensor, at::Tensor, at::Tensor, c10::optional<at::Tensor>) {
  TORCH_CHECK(false, "bf16_amx_linear: built without AMX-BF16 (kernels/linear_choice.py does not offer it here)");
}
#endif
