// Dispatch over the cache and bounds dtypes; the int8 bounds grid step.
// Part of the native CPU kernels of tinyserve-compile (overview: sparse_decode.cpp).
#pragma once

#include "simd.h"

namespace tinyserve_native {

// dispatch over the three cache dtypes (float32, bfloat16, float16)
template <typename F>
inline void dispatch_kv(at::ScalarType t, const char* name, const F& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, name, ": dtype must be float32, bfloat16 or float16, got ", t);
  }
}

// dispatch over the three bounds dtypes (float32, bfloat16 rounded outward, int8 codes)
template <typename F>
inline void dispatch_bt(at::ScalarType t, const char* name, const F& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kChar: f(int8_t{}); break;
    default: TORCH_CHECK(false, name, ": kmax/kmin must be float32, bfloat16 or int8, got ", t);
  }
}

// grid step of int8 bounds (reference.int8_bounds_step): one fp32 division, then the floor at the smallest normal
// number (NaN propagates, as torch.clamp_min)
inline float int8_step(float kabs) { return std::max(kabs / 126.f, std::numeric_limits<float>::min()); }
// the same step for VS pages at once (NaN kabs give NaN, as std::max(NaN, x) does above)
inline Vec int8_step(const Vec& kabs) {
  return at::vec::maximum(kabs / Vec(126.f), Vec(std::numeric_limits<float>::min()));
}

}  // namespace tinyserve_native
