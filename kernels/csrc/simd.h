// Vector helpers: at::vec loads, lane reductions, exp sums, prefetch, grow-only buffers.
// Part of the native CPU kernels of tinyserve-compile (overview: sparse_decode.cpp).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <exception>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <limits>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif
#include <unistd.h>

namespace tinyserve_native {

using at::vec::Vectorized;
using Vec = Vectorized<float>;
constexpr int VS = Vec::size();
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr float POS_INF = std::numeric_limits<float>::infinity();
// prefetch distance, in blocks of VS tokens, and the cache level prefetched rows go to (3: L1, 2: L2)
#ifndef TS_PF_BLOCKS
#define TS_PF_BLOCKS 3
#endif
#ifndef TS_PF_LOCALITY
#define TS_PF_LOCALITY 2
#endif
constexpr int PF_BLOCKS = TS_PF_BLOCKS;
constexpr int PF_LOCALITY = TS_PF_LOCALITY;

// ------------------------------------------------------------------------------------------------------------
// small vector helpers
// ------------------------------------------------------------------------------------------------------------

template <typename T>
inline Vec loadf(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec out;
    at::vec::load_to_float<T>(p, out);
    return out;
  }
}

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// r[i] = sum of the 8 lanes of a[i]
inline __m256 reduce8(const __m256* a) {
  __m256 t0 = _mm256_hadd_ps(a[0], a[1]);
  __m256 t1 = _mm256_hadd_ps(a[2], a[3]);
  __m256 t2 = _mm256_hadd_ps(a[4], a[5]);
  __m256 t3 = _mm256_hadd_ps(a[6], a[7]);
  __m256 u0 = _mm256_hadd_ps(t0, t1);
  __m256 u1 = _mm256_hadd_ps(t2, t3);
  __m256 lo = _mm256_permute2f128_ps(u0, u1, 0x20);
  __m256 hi = _mm256_permute2f128_ps(u0, u1, 0x31);
  return _mm256_add_ps(lo, hi);
}
#endif

// lane i of the result = sum of the lanes of a[i], for VS vectors
inline Vec reduce_rows(const Vec* a) {
#if defined(CPU_CAPABILITY_AVX512)
  __m256 y[16];
  for (int i = 0; i < 16; ++i) {
    __m512 z = a[i];
    __m256 lo = _mm512_castps512_ps256(z);
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1));
    y[i] = _mm256_add_ps(lo, hi);
  }
  __m256 r0 = reduce8(y);
  __m256 r1 = reduce8(y + 8);
  return _mm512_castpd_ps(
      _mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(r0)), _mm256_castps_pd(r1), 1));
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 y[8];
  for (int i = 0; i < 8; ++i) y[i] = a[i];
  return reduce8(y);
#else
  alignas(64) float out[VS];
  alignas(64) float tmp[VS];
  for (int i = 0; i < VS; ++i) {
    a[i].store(tmp);
    float s = 0.f;
    for (int j = 0; j < VS; ++j) s += tmp[j];
    out[i] = s;
  }
  return Vec::loadu(out);
#endif
}

// VS int8 codes at p as fp32 lanes (exact)
inline Vec load_i8(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  alignas(64) float t[VS];
  for (int i = 0; i < VS; ++i) t[i] = static_cast<float>(p[i]);
  return Vec::loadu(t);
#endif
}

inline float hmax(const float* x, int64_t n) {
  int64_t i = 0;
  float m = NEG_INF;
  if (n >= VS) {
    Vec mv(NEG_INF);
    for (; i + VS <= n; i += VS) mv = at::vec::maximum(mv, Vec::loadu(x + i));
    alignas(64) float t[VS];
    mv.store(t);
    for (int j = 0; j < VS; ++j) m = std::max(m, t[j]);
  }
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// x <- exp(x - m) in place, returns the sum (m finite)
inline float exp_sub_sum(float* x, int64_t n, float m) {
  int64_t i = 0;
  Vec mv(m), acc(0.f);
  for (; i + VS <= n; i += VS) {
    Vec e = (Vec::loadu(x + i) - mv).exp_u20();
    e.store(x + i);
    acc = acc + e;
  }
  float s = 0.f;
  if (i < n) {
    Vec e = (Vec::loadu(x + i, static_cast<int>(n - i)) - mv).exp_u20();
    e.store(x + i, static_cast<int>(n - i));
    alignas(64) float t[VS];
    e.store(t);
    for (int64_t j = 0; j < n - i; ++j) s += t[j];
  }
  alignas(64) float t[VS];
  acc.store(t);
  for (int j = 0; j < VS; ++j) s += t[j];
  return s;
}

// dst <- exp(src - m), returns the sum (m finite)
inline float exp_sub_to(const float* src, float* dst, int64_t n, float m) {
  int64_t i = 0;
  Vec mv(m), acc(0.f);
  for (; i + VS <= n; i += VS) {
    Vec e = (Vec::loadu(src + i) - mv).exp_u20();
    e.store(dst + i);
    acc = acc + e;
  }
  alignas(64) float t[VS];
  float s = 0.f;
  if (i < n) {
    const int r = static_cast<int>(n - i);
    Vec e = (Vec::loadu(src + i, r) - mv).exp_u20();
    e.store(dst + i, r);
    e.store(t);
    for (int j = 0; j < r; ++j) s += t[j];
  }
  acc.store(t);
  for (int j = 0; j < VS; ++j) s += t[j];
  return s;
}

inline float hsum(const float* x, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
  if (n >= VS) {
    Vec a(0.f);
    for (; i + VS <= n; i += VS) a = a + Vec::loadu(x + i);
    alignas(64) float t[VS];
    a.store(t);
    for (int j = 0; j < VS; ++j) s += t[j];
  }
  for (; i < n; ++i) s += x[i];
  return s;
}

// grow-only buffer (no page faults per call once warm)
template <typename V>
inline typename V::value_type* grow(V& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

inline void prefetch_row(const void* p, int64_t bytes, int locality) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) {
    if (locality >= 3)
      __builtin_prefetch(c + off, 0, 3);
    else if (locality == 2)
      __builtin_prefetch(c + off, 0, 2);
    else
      __builtin_prefetch(c + off, 0, 1);
  }
}

// grow-only scratch, one per thread and purpose (no page faults per call)
template <int Tag>
inline float* scratch_f(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

}  // namespace tinyserve_native
