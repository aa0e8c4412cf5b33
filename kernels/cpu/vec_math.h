// Small math shared by the CPU operators.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace trellm {

// exp(x) for x <= 88: 2^(x log2 e) split into an integer power, set in the exponent bits, and a degree-6 Taylor
// polynomial for the fraction (relative error below 2e-7, about one float ulp). Plain arithmetic, so `omp simd`
// loops over it vectorize; std::exp would leave them scalar.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float t = x * 1.4426950408889634f;
  const float fi = std::floor(t + 0.5f);  // f in [-0.5, 0.5): the Taylor terms below suffice there
  const float f = t - fi;
  float p = 1.5403530393381606e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  int32_t bits = (static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace trellm
