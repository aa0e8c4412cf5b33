// LoRA's extra term for the rows of one adapter at one fused site: out[i] += scale * ((x[i] A^T) B^T), with A^T
// and B^T given as at [K, R] and bt [R, N].
//
// Why: at decode sizes the term is a few thousand multiply-adds per row and site, but torch runs it as two matmuls
// and their views, each a dispatch and a wake-up of the thread pool that costs more than the arithmetic; with ten
// layers of four sites that was most of what an adapter cost a lone stream (perf/RESULTS.md, section "LoRA, second
// part").
// Here rows go four at a time on the calling thread, each weight read once per four rows, and the sums run along
// the rank and the columns (no horizontal reductions). B is block-diagonal over the site's modules (models/lora.py),
// so each rank row r of B^T touches only its module's columns, spans[r] = (first column, count).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t kRows = 4;   // rows that share each read of the weights

// Rows i0 .. i0 + NB - 1: t[b] = x[b] at (R values each), d[b] = t[b] bt (N each), out[b] += scale * d[b].
template <int NB>
void rows_block(const float* xp, int64_t xs, float* op, int64_t os, const float* at, const float* bt,
                const int64_t* spans, int64_t K, int64_t R, int64_t N, float scale, float* t, float* d) {
  std::fill(t, t + NB * R, 0.f);
  for (int64_t k = 0; k < K; ++k) {
    const float* ak = at + k * R;
    for (int b = 0; b < NB; ++b) {
      const float xk = xp[b * xs + k];
      float* tb = t + b * R;
#pragma omp simd
      for (int64_t r = 0; r < R; ++r) tb[r] += xk * ak[r];
    }
  }
  // PEFT's order: the expand's sum first, then the scale, then the add into the base output.
  std::fill(d, d + NB * N, 0.f);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t c0 = spans[2 * r], n = spans[2 * r + 1];
    const float* br = bt + r * N + c0;
    for (int b = 0; b < NB; ++b) {
      const float tr = t[b * R + r];
      float* db = d + b * N + c0;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) db[j] += tr * br[j];
    }
  }
  for (int b = 0; b < NB; ++b) {
    float* ob = op + b * os;
    const float* db = d + b * N;
#pragma omp simd
    for (int64_t j = 0; j < N; ++j) ob[j] += scale * db[j];
  }
}

}  // namespace

void lora_add_cpu(at::Tensor out, at::Tensor x, at::Tensor at, at::Tensor bt, at::Tensor spans,
                  double scale) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat &&
                  at.scalar_type() == at::kFloat && bt.scalar_type() == at::kFloat,
              "lora_add: out, x, at and bt must be float32");
  TORCH_CHECK(spans.scalar_type() == at::kLong && spans.dim() == 2 && spans.size(1) == 2 && spans.is_contiguous(),
              "lora_add: spans must be int64 [R, 2] (first column, count)");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && at.dim() == 2 && bt.dim() == 2, "lora_add: 2-D tensors only");
  const int64_t T = x.size(0), K = x.size(1), R = at.size(1), N = bt.size(1);
  TORCH_CHECK(out.size(0) == T && at.size(0) == K && bt.size(0) == R && out.size(1) == N && spans.size(0) == R,
              "lora_add: shapes out [T, N], x [T, K], at [K, R], bt [R, N], spans [R, 2]; got out ", out.sizes(),
              ", x ", x.sizes(), ", at ", at.sizes(), ", bt ", bt.sizes(), ", spans ", spans.sizes());
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && at.is_contiguous() && bt.is_contiguous(),
              "lora_add: rows of x and out, and at and bt, must be contiguous");
  const int64_t* sp = spans.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(sp[2 * r] >= 0 && sp[2 * r + 1] >= 0 && sp[2 * r] + sp[2 * r + 1] <= N,
                "lora_add: spans[", r, "] leaves the ", N, " columns");
  const float* xp = x.data_ptr<float>();
  const float* ap = at.data_ptr<float>();
  const float* bp = bt.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  const float s = static_cast<float>(scale);
  // Blocks of rows go to the thread pool only once there are enough of them to pay for waking it.
  const int64_t blocks = (T + kRows - 1) / kRows;
  const int64_t work = kRows * R * (K + N);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 21) / std::max<int64_t>(work, 1));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> t(kRows * R), d(kRows * N);
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t i0 = blk * kRows, nb = std::min(kRows, T - i0);
      const float* xb = xp + i0 * xs;
      float* ob = op + i0 * os;
      switch (nb) {
        case 4: rows_block<4>(xb, xs, ob, os, ap, bp, sp, K, R, N, s, t.data(), d.data()); break;
        case 3: rows_block<3>(xb, xs, ob, os, ap, bp, sp, K, R, N, s, t.data(), d.data()); break;
        case 2: rows_block<2>(xb, xs, ob, os, ap, bp, sp, K, R, N, s, t.data(), d.data()); break;
        default: rows_block<1>(xb, xs, ob, os, ap, bp, sp, K, R, N, s, t.data(), d.data()); break;
      }
    }
  });
}
