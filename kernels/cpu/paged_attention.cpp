// Paged attention for CPUs, reading K/V where they lie in the paged cache.
//
// Why a C++ operator: on a CPU the PyTorch path must gather every sequence's blocks into new tensors on every
// layer and then multiply many tiny matrices; that gather and its layout copies were most of a decode step. Here
// each work item (one sequence, one KV head, a tile of query rows) walks its block table and keeps an online
// softmax (running max, running sum, running weighted V) in a few KiB of L1, so K and V are read once, in place.
//
// An INT8 or FP8 e4m3 cache (kv_cache_dtype) carries one float16 scale per token and KV head beside it
// ([num_blocks, block_size, KVH]): a key's scale multiplies its scores, a value's its softmax weight (or the value
// as it is converted to float), so values are read as 1-byte integers: a quarter of fp32's bytes.
//
// Layouts (all contiguous): q, out [T, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D];
// cu_seqlens_q [B+1], seq_lens [B], block_tables [B, max_blocks] (int32). Query row i of sequence b sits at
// position seq_lens[b] - q_len + i and sees keys 0..that position, or with a sliding window (window > 0) the last
// `window` of them. softcap > 0 caps each scaled score s at softcap * tanh(s / softcap) (Gemma 2). The G = H / KVH
// query heads of a KV head are processed together, so each K/V block is converted and read once for all of them.
// Sequences with more than max_q_len query rows are skipped (their output rows are left as they are): long prefill
// chunks are compute-bound and run faster in torch's fused attention (kernels/attention.py), whose gather is small
// next to their work.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <limits>
#include <vector>

#include "vec_math.h"

namespace {

using trellm::exp_approx;
using trellm::fp8_e4m3;
using trellm::load16;
using trellm::v16;

// Scores of every row against `n` <= 16 consecutive slots, for rows with few others on the same head (decodes,
// short chunks). Slots are read in order, all of a slot's heads at once (the cache streams front to back); each
// dot product stays a 16-lane partial sum in `part` ([rows][16]), and one shuffle tree per row folds 16 of them
// into 16 scores. The same slots' values are prefetched for the weighted sum that follows. D is a multiple of 16;
// kb and vb point at the first slot's keys and values of the item's first KV head; a slot's item heads span
// `item_width` elements.
// Quantized caches: ksc (non-null) holds the item's key scales as float, [n_kv][BS] from the first slot's.
// A bf16 cache with bf16 queries on a CPU with AVX512-BF16 (qh non-null: the item's queries unscaled, [rows][D], D a
// multiple of 32): each dot product is D/32 VDPBF16PS on the bf16 values as they lie (the products exact, summed in
// float), times `qh_scale` once summed, so no key is widened to float, once per row as the float path must.
template <typename kv_t>
inline void slot_scores_16(const float* qs, int64_t rows, int64_t heads, int64_t G, int64_t D, const kv_t* kb,
                           const kv_t* vb, int64_t slot_stride, int64_t item_width, int64_t n, v16* part,
                           float* s, int64_t s_stride, const float* ksc, int64_t BS,
                           const c10::BFloat16* qh = nullptr, float qh_scale = 1.f) {
  constexpr int64_t kLine = 64 / sizeof(kv_t);
  for (int64_t jj = 0; jj < 16; ++jj) {
    if (jj >= n) {
      for (int64_t r = 0; r < rows; ++r) part[r * 16 + jj] = v16{};
      continue;
    }
    const kv_t* kj = kb + jj * slot_stride;
    for (int64_t e = 0; e < item_width; e += kLine) __builtin_prefetch(vb + jj * slot_stride + e);
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<kv_t, c10::BFloat16>) {
      if (qh != nullptr) {
        for (int64_t r = 0; r < rows;)
          for (int64_t h = 0; h * G < heads; ++h)
            for (int64_t g = 0; g < G; ++g, ++r) {
              const c10::BFloat16* kh = kj + h * D;
              const c10::BFloat16* qr = qh + r * D;
              __m512 a = _mm512_setzero_ps();
              for (int64_t d = 0; d < D; d += 32) {
                const __m512i qv = _mm512_loadu_si512(qr + d), kv = _mm512_loadu_si512(kh + d);
                a = _mm512_dpbf16_ps(a, (__m512bh)qv, (__m512bh)kv);
              }
              part[r * 16 + jj] = (v16)a;
            }
        continue;
      }
    }
#endif
    // Row r = (position, KV head h, one of its G query heads), in that order: counted, not divided out per slot.
    for (int64_t r = 0; r < rows;)
      for (int64_t h = 0; h * G < heads; ++h)
        for (int64_t g = 0; g < G; ++g, ++r) {
          const kv_t* kh = kj + h * D;
          const float* qr = qs + r * D;
#if defined(TRELLM_AVX2)
          __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
          for (int64_t d = 0; d < D; d += 16) {
            __m256 q0, q1, k0, k1;
            trellm::load8x2(qr + d, q0, q1);
            trellm::load8x2(kh + d, k0, k1);
            a0 = _mm256_fmadd_ps(q0, k0, a0);
            a1 = _mm256_fmadd_ps(q1, k1, a1);
          }
          if (ksc) {
            const __m256 sc = _mm256_set1_ps(ksc[h * BS + jj]);
            a0 = _mm256_mul_ps(a0, sc);
            a1 = _mm256_mul_ps(a1, sc);
          }
          float* lanes = reinterpret_cast<float*>(part + r * 16 + jj);
          _mm256_storeu_ps(lanes, a0);
          _mm256_storeu_ps(lanes + 8, a1);
#else
          v16 a = {};
          for (int64_t d = 0; d < D; d += 16) a += load16(qr + d) * load16(kh + d);
          part[r * 16 + jj] = ksc ? a * ksc[h * BS + jj] : a;
#endif
        }
  }
  for (int64_t r = 0; r < rows; ++r) {
    v16 sums = trellm::sum_lanes_16(part + r * 16);
    if (qh != nullptr) sums *= qh_scale;
    std::memcpy(s + r * s_stride, &sums, n * sizeof(float));
  }
}

// acc[0:16 NV] += sum_j p[j] * v_j[0:16 NV] with the running sum in NV registers; v_j = v + j * stride.
// With AVX2 only, two 8-float registers per 16 lanes (vec_math.h says why).
template <int NV, typename kv_t>
inline void accumulate_values(float* acc, const float* p, int64_t n, const kv_t* v, int64_t stride) {
#if defined(TRELLM_AVX2)
  __m256 a[2 * NV];
  for (int i = 0; i < 2 * NV; ++i) a[i] = _mm256_loadu_ps(acc + 8 * i);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const kv_t* vj = v + j * stride;
    for (int i = 0; i < NV; ++i) {
      __m256 lo, hi;
      trellm::load8x2(vj + 16 * i, lo, hi);
      a[2 * i] = _mm256_fmadd_ps(pj, lo, a[2 * i]);
      a[2 * i + 1] = _mm256_fmadd_ps(pj, hi, a[2 * i + 1]);
    }
  }
  for (int i = 0; i < 2 * NV; ++i) _mm256_storeu_ps(acc + 8 * i, a[i]);
#else
  v16 a[NV];
  for (int i = 0; i < NV; ++i) a[i] = load16(acc + 16 * i);
  for (int64_t j = 0; j < n; ++j) {
    const float pj = p[j];
    const kv_t* vj = v + j * stride;
    for (int i = 0; i < NV; ++i) a[i] += pj * load16(vj + 16 * i);
  }
  for (int i = 0; i < NV; ++i) trellm::store16(acc + 16 * i, a[i]);
#endif
}

#if defined(__AVX512F__)
// accumulate_values for GR query rows of one KV head at once (rows of acc and of p `acc_stride` / `p_stride` apart):
// each value vector is read, and widened from bf16/fp16, once for the GR rows instead of once per row.
template <int NV, int GR, typename kv_t>
inline void accumulate_values_rows(float* acc, int64_t acc_stride, const float* p, int64_t p_stride, int64_t n,
                                   const kv_t* v, int64_t stride) {
  v16 a[GR][NV];
  for (int g = 0; g < GR; ++g)
    for (int i = 0; i < NV; ++i) a[g][i] = load16(acc + g * acc_stride + 16 * i);
  for (int64_t j = 0; j < n; ++j) {
    const kv_t* vj = v + j * stride;
    v16 vv[NV];
    for (int i = 0; i < NV; ++i) vv[i] = load16(vj + 16 * i);
    for (int g = 0; g < GR; ++g) {
      const float pj = p[g * p_stride + j];
      for (int i = 0; i < NV; ++i) a[g][i] += pj * vv[i];
    }
  }
  for (int g = 0; g < GR; ++g)
    for (int i = 0; i < NV; ++i) trellm::store16(acc + g * acc_stride + 16 * i, a[g][i]);
}

// The G rows of one KV head from acc and p, GR_MAX at a time (the accumulators and one value vector in registers).
template <int NV, typename kv_t>
inline void accumulate_head_rows(float* acc, int64_t D, const float* p, int64_t p_stride, int64_t G, int64_t n,
                                 const kv_t* v, int64_t stride) {
  constexpr int GR_MAX = NV == 4 ? 4 : 2;
  for (int64_t g = 0; g < G; g += GR_MAX) {
    float* ag = acc + g * D;
    const float* pg = p + g * p_stride;
    switch (std::min<int64_t>(GR_MAX, G - g)) {   // cases above GR_MAX never run; they instantiate GR 1
      case 4: accumulate_values_rows<NV, 4 <= GR_MAX ? 4 : 1>(ag, D, pg, p_stride, n, v, stride); break;
      case 3: accumulate_values_rows<NV, 3 <= GR_MAX ? 3 : 1>(ag, D, pg, p_stride, n, v, stride); break;
      case 2: accumulate_values_rows<NV, 2>(ag, D, pg, p_stride, n, v, stride); break;
      default: accumulate_values_rows<NV, 1>(ag, D, pg, p_stride, n, v, stride);
    }
  }
}
#endif

constexpr int64_t kTileRows = 32;      // query positions per work item; each brings its G heads
constexpr int64_t kTransposeRows = 8;  // from this many rows per item on, a block's keys are transposed once

struct WorkItem {
  int64_t seq, kv_begin, kv_end, row_begin, row_end, cost;
};

// Scores of `rows` query vectors (already scaled, float, [rows][D]) against one block's keys, transposed to
// [D][BS] so the inner loop runs along the block's slots. BS is a compile-time constant for the common sizes.
template <int BS_FIXED>
inline void block_scores(const float* qs, int64_t rows, int64_t D, const float* kt, float* s, int64_t bs) {
  const int64_t BS = BS_FIXED > 0 ? BS_FIXED : bs;
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = s + r * BS;
    for (int64_t j = 0; j < BS; ++j) sr[j] = 0.f;
    const float* qr = qs + r * D;
    for (int64_t d = 0; d < D; ++d) {
      const float qd = qr[d];
      const float* kd = kt + d * BS;
#pragma omp simd
      for (int64_t j = 0; j < BS; ++j) sr[j] += qd * kd[j];
    }
  }
}

// kv_t: the cache's type, scalar_t (q and out) for a float cache, int8_t or fp8_e4m3 for a quantized one, whose
// float16 scales are ks, vs ([num_blocks, block_size, KVH]).
template <typename scalar_t, typename kv_t, int BS_FIXED>
void attend(const WorkItem& w, const scalar_t* q, const kv_t* kc, const kv_t* vc, const at::Half* ks,
            const at::Half* vs, scalar_t* out, const int32_t* cu, const int32_t* seq_lens, const int32_t* tables,
            int64_t max_blocks, int64_t H, int64_t KVH, int64_t D, int64_t BS_RUNTIME, float scale, int64_t window,
            float softcap) {
  const int64_t BS = BS_FIXED > 0 ? BS_FIXED : BS_RUNTIME;
  const int64_t G = H / KVH;
  const int64_t q_start = cu[w.seq];
  const int64_t q_len = cu[w.seq + 1] - q_start;
  const int64_t ctx = seq_lens[w.seq];
  const int64_t first_pos = ctx - q_len;          // position of the sequence's first query row
  const int64_t n_pos = w.row_end - w.row_begin;
  const int64_t n_kv = w.kv_end - w.kv_begin;
  const int64_t heads = n_kv * G;                 // query heads of the item, contiguous from kv_begin * G
  const int64_t rows = n_pos * heads;             // row r: position row_begin + r / heads, head kv_begin*G + r % heads
  const int64_t kv_end = first_pos + w.row_end;   // keys [0, kv_end) are visible to some row of the item
  const bool transposed = n_kv == 1 && rows >= kTransposeRows;
  constexpr bool kFloat = std::is_same_v<kv_t, float>;
  constexpr bool kQuant = std::is_same_v<kv_t, int8_t> || std::is_same_v<kv_t, fp8_e4m3>;
  // Quantized values with D 64 or 128 are read straight from the cache, the value scale folded into p; other
  // non-float caches are converted into vb per block first.
  // bf16/fp16 values too, widened as they are summed (vec_math.h: 8 at a time with AVX2, 16 with AVX-512), where few
  // rows share a head (decodes: converting each block into float first was a second pass over every value); where
  // many do (transposed keys, prefill chunks) each value is converted once into vb instead of once per row.
  constexpr bool kHalf = std::is_same_v<kv_t, c10::BFloat16> || std::is_same_v<kv_t, c10::Half>;
  const bool direct_values = kFloat || ((kQuant || (kHalf && !transposed)) && (D == 64 || D == 128));
  // AVX-512, bf16/fp16 values: the G query rows of a KV head sum each value vector together, widened once for all of
  // them. Float values stay per row: they need no widening, and grouped the fp32 anchor ran slower (perf/RESULTS.md).
#if defined(__AVX512F__)
  const bool group_values = kHalf && direct_values && G > 1;
#else
  constexpr bool group_values = false;
#endif

  thread_local std::vector<v16> part_buf;          // [rows][16] partial dot products (slot_scores_16)
  if (part_buf.size() < static_cast<size_t>(rows * 16)) part_buf.resize(rows * 16);
  v16* part = part_buf.data();
  thread_local std::vector<float> buf;
  const size_t need = rows * D * 2 + rows * 2 + rows * BS + D * BS + n_kv * BS * D + 2 * n_kv * BS + BS;
  if (buf.size() < need) buf.resize(need);
  float* qs = buf.data();            // [rows][D] scaled queries
  float* acc = qs + rows * D;        // [rows][D] running sum of p * V
  float* m = acc + rows * D;         // [rows] running max
  float* l = m + rows;               // [rows] running sum of p
  float* s = l + rows;               // [rows][BS] scores of the current block
  float* kt = s + rows * BS;         // [D][BS] keys of the current block, transposed (one KV head)
  float* vb = kt + D * BS;           // [n_kv][BS][D] values of the current block as float (non-float caches)
  float* ksc = vb + n_kv * BS * D;   // [n_kv][BS] key scales of the current block (quantized caches)
  float* vsc = ksc + n_kv * BS;      // [n_kv][BS] value scales
  float* pv = vsc + n_kv * BS;       // [BS] softmax weights times the value scales

  for (int64_t p = 0; p < n_pos; ++p) {
    const scalar_t* qrow = q + ((q_start + w.row_begin + p) * H + w.kv_begin * G) * D;
    for (int64_t i = 0; i < heads * D; ++i) qs[p * heads * D + i] = static_cast<float>(qrow[i]) * scale;
  }
  // bf16 queries and keys with bf16 dot products: the scores from the bf16 values (slot_scores_16).
  const c10::BFloat16* qh = nullptr;
#if defined(__AVX512BF16__)
  thread_local std::vector<c10::BFloat16> qh_buf;
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<kv_t, c10::BFloat16>) {
    if (!transposed && D % 32 == 0) {
      if (qh_buf.size() < static_cast<size_t>(rows * D)) qh_buf.resize(rows * D);
      for (int64_t p = 0; p < n_pos; ++p)
        std::memcpy(qh_buf.data() + p * heads * D, q + ((q_start + w.row_begin + p) * H + w.kv_begin * G) * D,
                    heads * D * sizeof(c10::BFloat16));
      qh = qh_buf.data();
    }
  }
#endif
  std::fill(acc, acc + rows * D, 0.f);
  std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
  std::fill(l, l + rows, 0.f);

  const int32_t* table = tables + w.seq * max_blocks;
  const int64_t n_blocks = (kv_end + BS - 1) / BS;
  // With a window, blocks wholly before the item's first row's window are never read (they may be freed).
  const int64_t first_block = window > 0 ? std::max<int64_t>(0, first_pos + w.row_begin - window + 1) / BS : 0;
  const int64_t slot_stride = KVH * D;
  for (int64_t nb = first_block; nb < n_blocks; ++nb) {
    const int64_t block = table[nb];
    const int64_t base = nb * BS;
    const int64_t valid = std::min<int64_t>(BS, kv_end - base);
    const kv_t* kb = kc + (block * BS * KVH + w.kv_begin) * D;     // slot j, head h: kb[j*slot_stride + h*D]
    const kv_t* vblk = vc + (block * BS * KVH + w.kv_begin) * D;
    if constexpr (kQuant) {
      const at::Half* kh = ks + block * BS * KVH + w.kv_begin;
      const at::Half* vh = vs + block * BS * KVH + w.kv_begin;
      for (int64_t h = 0; h < n_kv; ++h)
        for (int64_t j = 0; j < valid; ++j) {
          ksc[h * BS + j] = static_cast<float>(kh[j * KVH + h]);
          vsc[h * BS + j] = static_cast<float>(vh[j * KVH + h]);
        }
    }
    if (!direct_values) {
      for (int64_t h = 0; h < n_kv; ++h)
        for (int64_t j = 0; j < valid; ++j) {
          const kv_t* vj = vblk + j * slot_stride + h * D;
          const float sc = kQuant ? vsc[h * BS + j] : 1.f;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) vb[(h * BS + j) * D + d] = static_cast<float>(vj[d]) * sc;
        }
    }
    if (transposed) {
      // Many rows share one head's keys: transpose them once to [D][BS] so scores run along the slots.
      for (int64_t j = 0; j < valid; ++j) {
        const kv_t* kj = kb + j * slot_stride;
        const float sc = kQuant ? ksc[j] : 1.f;
        for (int64_t d = 0; d < D; ++d) kt[d * BS + j] = static_cast<float>(kj[d]) * sc;
      }
      for (int64_t j = valid; j < BS; ++j)
        for (int64_t d = 0; d < D; ++d) kt[d * BS + j] = 0.f;
      block_scores<BS_FIXED>(qs, rows, D, kt, s, BS);
    } else {
      // Few rows per head (decodes): dot products along D straight from the cache, so a sequence's block is
      // read front to back once for all its heads.
      if (D % 16 == 0) {
        for (int64_t j0 = 0; j0 < valid; j0 += 16)
          slot_scores_16(qs, rows, heads, G, D, kb + j0 * slot_stride, vblk + j0 * slot_stride, slot_stride,
                         n_kv * D, std::min<int64_t>(16, valid - j0), part, s + j0, BS, kQuant ? ksc + j0 : nullptr,
                         BS, qh, scale);
      } else {
        for (int64_t j = 0; j < valid; ++j) {
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t h = (r % heads) / G;
            const kv_t* kj = kb + j * slot_stride + h * D;
            const float* qr = qs + r * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qr[d] * static_cast<float>(kj[d]);
            s[r * BS + j] = kQuant ? dot * ksc[h * BS + j] : dot;
          }
        }
      }
    }

    // The row of position pos sees slots [first, visible) of the block: up to its own position (causal), never
    // past the block's valid slots, and with a window none before position pos - window + 1.
    const auto seen = [&](int64_t pos) {
      return std::pair<int64_t, int64_t>{window > 0 ? std::max<int64_t>(0, pos - window + 1 - base) : 0,
                                         std::min<int64_t>(valid, pos - base + 1)};
    };
    for (int64_t r = 0; r < rows; ++r) {
      const auto [first, visible] = seen(first_pos + w.row_begin + r / heads);
      if (visible <= first) continue;
      const int64_t h = (r % heads) / G;
      float* sr = s + r * BS + first;
      const int64_t n = visible - first;
      if (softcap > 0.f)
        for (int64_t j = 0; j < n; ++j) sr[j] = softcap * std::tanh(sr[j] / softcap);
      // The block's largest score, 16 lanes at a time (a scalar max chain costs its latency per slot).
      float block_max = sr[0];
      int64_t jm = 0;
      if (n >= 16) {
        v16 mx = load16(sr);
        for (jm = 16; jm + 16 <= n; jm += 16) {
          const v16 x = load16(sr + jm);
          mx = mx > x ? mx : x;
        }
        for (int i = 0; i < 16; ++i) block_max = std::max(block_max, mx[i]);
      }
      for (; jm < n; ++jm) block_max = std::max(block_max, sr[jm]);
      const float new_max = std::max(m[r], block_max);
      const float correction = m[r] == -std::numeric_limits<float>::infinity() ? 0.f : exp_approx(m[r] - new_max);
      // 16 lanes at a time (exp16): GCC leaves exp_approx's loop scalar on AVX-512 builds.
      v16 sum16 = {};
      int64_t j = 0;
      for (; j + 16 <= n; j += 16) {
        const v16 e = trellm::exp16(load16(sr + j) - new_max);
        trellm::store16(sr + j, e);
        sum16 += e;
      }
      float sum = 0.f;
      for (int i = 0; i < 16; ++i) sum += sum16[i];
      for (; j < n; ++j) {
        sr[j] = exp_approx(sr[j] - new_max);
        sum += sr[j];
      }
      l[r] = l[r] * correction + sum;
      m[r] = new_max;
      float* ar = acc + r * D;
      if (correction != 1.f) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ar[d] *= correction;
      }
      if (group_values) continue;   // summed below, a KV head's rows together
      if ((kHalf || kQuant) && direct_values) {   // values read where they lie; a quantized one's scale into p
        const float* p = sr;
        if constexpr (kQuant) {
          const float* vh = vsc + h * BS + first;
#pragma omp simd
          for (int64_t j = 0; j < n; ++j) pv[j] = sr[j] * vh[j];
          p = pv;
        }
        const kv_t* vfirst = vblk + first * slot_stride + h * D;
        if (D == 64) accumulate_values<4>(ar, p, n, vfirst, slot_stride);
        else accumulate_values<8>(ar, p, n, vfirst, slot_stride);
        continue;
      }
      const float* v0;
      int64_t v_stride;
      if constexpr (kFloat) v0 = vblk + first * slot_stride + h * D, v_stride = slot_stride;
      else v0 = vb + (h * BS + first) * D, v_stride = D;
      if (D == 64) accumulate_values<4>(ar, sr, n, v0, v_stride);
      else if (D == 128) accumulate_values<8>(ar, sr, n, v0, v_stride);
      else
        for (int64_t j = 0; j < n; ++j) {
          const float pj = sr[j];
          const float* vj = v0 + j * v_stride;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ar[d] += pj * vj[d];
        }
    }
#if defined(__AVX512F__)
    if (group_values)
      for (int64_t p = 0; p < n_pos; ++p) {
        const auto [first, visible] = seen(first_pos + w.row_begin + p);
        if (visible <= first) continue;
        for (int64_t h = 0; h < n_kv; ++h) {
          const int64_t r0 = p * heads + h * G;
          const kv_t* vfirst = vblk + first * slot_stride + h * D;
          if (D == 64)
            accumulate_head_rows<4>(acc + r0 * D, D, s + r0 * BS + first, BS, G, visible - first, vfirst, slot_stride);
          else
            accumulate_head_rows<8>(acc + r0 * D, D, s + r0 * BS + first, BS, G, visible - first, vfirst, slot_stride);
        }
      }
#endif
  }

  for (int64_t p = 0; p < n_pos; ++p) {
    scalar_t* orow = out + ((q_start + w.row_begin + p) * H + w.kv_begin * G) * D;
    for (int64_t i = 0; i < heads; ++i) {
      const int64_t r = p * heads + i;
      const float inv = 1.f / l[r];
      if (D % 16 == 0)
        for (int64_t d = 0; d < D; d += 16) trellm::store16(orow + i * D + d, load16(acc + r * D + d) * inv);
      else
        for (int64_t d = 0; d < D; ++d) orow[i * D + d] = trellm::round_to<scalar_t>(acc[r * D + d] * inv);
    }
  }
}

template <typename scalar_t, typename kv_t>
void run_all(const std::vector<WorkItem>& items, const scalar_t* q, const kv_t* kc, const kv_t* vc, const at::Half* ks,
             const at::Half* vs, scalar_t* out, const int32_t* cu, const int32_t* seq_lens, const int32_t* tables,
             int64_t max_blocks, int64_t H, int64_t KVH, int64_t D, int64_t BS, float scale, int64_t window,
             float softcap) {
  // Items are sorted longest first and taken from a shared counter: the threads of torch's own pool balance
  // sequences of very different lengths (cpu_ops.py builds with OpenMP for torch's own libgomp).
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      const WorkItem& w = items[i];
#define TRELLM_ATTEND(BSF) \
  attend<scalar_t, kv_t, BSF>(w, q, kc, vc, ks, vs, out, cu, seq_lens, tables, max_blocks, H, KVH, D, BS, scale, \
                                     window, softcap)
      if (BS == 16) TRELLM_ATTEND(16);
      else if (BS == 32) TRELLM_ATTEND(32);
      else if (BS == 128) TRELLM_ATTEND(128);
      else TRELLM_ATTEND(0);
#undef TRELLM_ATTEND
    }
  });
}

}  // namespace

namespace {

std::vector<WorkItem> work_items(at::Tensor q, at::Tensor out, at::Tensor k_cache, at::Tensor v_cache,
                                 at::Tensor cu_seqlens_q, at::Tensor seq_lens, at::Tensor block_tables,
                                 int64_t max_q_len, int64_t window) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention_cpu: q, out and the caches must be contiguous");
  TORCH_CHECK(cu_seqlens_q.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "paged_attention_cpu: cu_seqlens_q, seq_lens and block_tables must be int32 (block_tables contiguous)");
  TORCH_CHECK(q.scalar_type() == out.scalar_type(), "paged_attention_cpu: q and out must share a dtype");
  const int64_t H = q.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(H % KVH == 0, "paged_attention_cpu: num_heads must be a multiple of num_kv_heads");
  const int64_t B = seq_lens.size(0);
  const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();

  // Work items: a tile of query rows of one sequence over a range of KV heads. Decodes take all KV heads of
  // their sequence at once (each block is then read front to back) unless that leaves threads idle; prefill
  // tiles take one KV head, whose keys they transpose once for all their rows.
  int64_t n_decode_rows = 0;
  for (int64_t b = 0; b < B; ++b) n_decode_rows += (cu[b + 1] - cu[b]) <= kTransposeRows;
  const int64_t want = 4 * at::get_num_threads();
  int64_t kv_split = 1;
  while (kv_split < KVH && n_decode_rows * kv_split < want) kv_split *= 2;
  while (KVH % kv_split) --kv_split;
  std::vector<WorkItem> items;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = cu[b + 1] - cu[b];
    if (q_len > max_q_len) continue;  // the caller computes these rows another way
    const int64_t first_pos = lens[b] - q_len;
    for (int64_t r0 = 0; r0 < q_len; r0 += kTileRows) {
      const int64_t r1 = std::min(q_len, r0 + kTileRows);
      const int64_t per_item = q_len <= kTransposeRows ? KVH / kv_split : 1;
      for (int64_t h = 0; h < KVH; h += per_item)
        items.push_back({b, h, h + per_item, r0, r1,
                         (r1 - r0) * per_item * (window > 0 ? std::min(window, first_pos + r1) : first_pos + r1)});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return items;
}

}  // namespace

void paged_attention_cpu(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                         at::Tensor cu_seqlens_q, at::Tensor seq_lens, at::Tensor block_tables,
                         double scale, int64_t max_q_len, int64_t window, double softcap) {
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "paged_attention_cpu: q, out and the caches must share a dtype");
  const auto items = work_items(q, out, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_q_len, window);
  const int64_t H = q.size(1), D = q.size(2), BS = k_cache.size(1), KVH = k_cache.size(2);
  const int32_t *cu = cu_seqlens_q.data_ptr<int32_t>(), *lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_cpu", [&] {
    run_all<scalar_t, scalar_t>(items, q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                                v_cache.data_ptr<scalar_t>(), nullptr, nullptr, out.data_ptr<scalar_t>(), cu, lens,
                                tables, block_tables.size(1), H, KVH, D, BS, static_cast<float>(scale), window,
                                static_cast<float>(softcap));
  });
}

// The same over an INT8 (is_int8) or FP8 e4m3 cache, given as int8 views of its bytes, with float16 scales
// [num_blocks, block_size, KVH]; q and out float32 or bfloat16.
void paged_attention_quantized_cpu(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                   at::Tensor k_scale, at::Tensor v_scale, at::Tensor cu_seqlens_q,
                                   at::Tensor seq_lens, at::Tensor block_tables, double scale, int64_t max_q_len,
                                   bool is_int8, int64_t window, double softcap) {
  TORCH_CHECK(k_cache.scalar_type() == at::kChar && v_cache.scalar_type() == at::kChar &&
                  k_scale.scalar_type() == at::kHalf && v_scale.scalar_type() == at::kHalf &&
                  k_scale.is_contiguous() && v_scale.is_contiguous(),
              "paged_attention_quantized: caches as int8 views, contiguous float16 scales");
  const auto items = work_items(q, out, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_q_len, window);
  const int64_t H = q.size(1), D = q.size(2), BS = k_cache.size(1), KVH = k_cache.size(2);
  const int32_t *cu = cu_seqlens_q.data_ptr<int32_t>(), *lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const at::Half *ks = k_scale.data_ptr<at::Half>(), *vs = v_scale.data_ptr<at::Half>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_attention_quantized", [&] {
    if (is_int8)
      run_all<scalar_t, int8_t>(items, q.data_ptr<scalar_t>(), k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(),
                                ks, vs, out.data_ptr<scalar_t>(), cu, lens, tables, block_tables.size(1), H, KVH, D,
                                BS, static_cast<float>(scale), window, static_cast<float>(softcap));
    else
      run_all<scalar_t, fp8_e4m3>(items, q.data_ptr<scalar_t>(),
                                  reinterpret_cast<const fp8_e4m3*>(k_cache.data_ptr<int8_t>()),
                                  reinterpret_cast<const fp8_e4m3*>(v_cache.data_ptr<int8_t>()), ks, vs,
                                  out.data_ptr<scalar_t>(), cu, lens, tables, block_tables.size(1), H, KVH, D, BS,
                                  static_cast<float>(scale), window, static_cast<float>(softcap));
  });
}
