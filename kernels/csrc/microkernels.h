// Micro-kernels: row conversion, blocked dots, bound scores, value accumulation.
// Part of the native CPU kernels of tinyserve-compile (overview: sparse_decode.cpp).
#pragma once

#include "dtypes.h"
#include "simd.h"

namespace tinyserve_native {

// n rows of T -> fp32 rows of Dp floats (zero padded) at dst
template <typename T>
inline void rows_to_f32(const T* const* src, int n, int64_t D, int64_t Dp, float* dst) {
  for (int r = 0; r < n; ++r) {
    const T* s = src[r];
    float* d = dst + r * Dp;
    int64_t i = 0;
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(d, s, D * sizeof(float));
      i = D;
    } else {
      for (; i + VS <= D; i += VS) loadf(s + i).store(d + i);
      for (; i < D; ++i) d[i] = static_cast<float>(s[i]);
    }
    for (; i < Dp; ++i) d[i] = 0.f;
  }
}

// n rows of int8 bound codes -> fp32 rows of Dp floats (zero padded) at dst: code * step of the row's page
inline void int8_rows_to_f32(const int8_t* src, const float* kab, int n, int64_t D, int64_t Dp, float* dst) {
  for (int r = 0; r < n; ++r) {
    const int8_t* s = src + r * D;
    float* d = dst + r * Dp;
    const float step = int8_step(kab[r]);
    for (int64_t i = 0; i < D; ++i) d[i] = static_cast<float>(s[i]) * step;  // vectorised by the compiler
    for (int64_t i = D; i < Dp; ++i) d[i] = 0.f;
  }
}

// Micro-kernels on a block of VS fp32 rows stored contiguously (row stride nv * VS floats). NV > 0 fixes nv at
// compile time, so that every row is addressed with an immediate offset from one base register; NV == 0 is the
// generic version. One is picked per call (Kern::pick).

// out[g * ld + j] = q_g . row_j for j < n (the block has VS readable rows)
template <int NV>
void dot_block(const float* rows, int n, const float* q, int64_t G, int64_t nv_rt, float* out, int64_t ld) {
  const int64_t nv = NV > 0 ? NV : nv_rt, st = nv * VS;
  for (int64_t g = 0; g < G; ++g) {
    Vec acc[VS];
    for (int j = 0; j < VS; ++j) acc[j] = Vec(0.f);
    const float* qg = q + g * st;
    for (int64_t i = 0; i < nv; ++i) {
      const Vec qv = Vec::loadu(qg + i * VS);
      for (int j = 0; j < VS; ++j) acc[j] = at::vec::fmadd(qv, Vec::loadu(rows + j * st + i * VS), acc[j]);
    }
    reduce_rows(acc).store(out + g * ld, n);
  }
}

// r_j = relu(qp).M_j + min(q,0).m_j for the VS pages of a block (sum_d max(q_d M_jd, q_d m_jd))
template <int NV>
Vec bound_block(const float* M, const float* m, const float* qp, const float* qn, int64_t nv_rt) {
  const int64_t nv = NV > 0 ? NV : nv_rt, st = nv * VS;
  Vec acc[VS];
  for (int j = 0; j < VS; ++j) acc[j] = Vec(0.f);
  for (int64_t i = 0; i < nv; ++i) {
    const Vec a = Vec::loadu(qp + i * VS);
    const Vec z = Vec::loadu(qn + i * VS);
    for (int j = 0; j < VS; ++j) {
      acc[j] = at::vec::fmadd(a, Vec::loadu(M + j * st + i * VS), acc[j]);
      acc[j] = at::vec::fmadd(z, Vec::loadu(m + j * st + i * VS), acc[j]);
    }
  }
  return reduce_rows(acc);
}

// Micro-kernels on VS rows addressed one pointer each (rows[j] for j < VS, every pointer readable), read in
// place: the gathered token rows of the cache need no copy. The arithmetic (FMA order, reduction) is that of the
// contiguous versions above, so the results are bit-identical.

// out[g * ld + j] = q_g . rows[j] for j < n
template <int NV>
void dot_rows(const float* const* rows, int n, const float* q, int64_t G, int64_t nv_rt, float* out, int64_t ld) {
  const int64_t nv = NV > 0 ? NV : nv_rt, st = nv * VS;
  for (int64_t g = 0; g < G; ++g) {
    Vec acc[VS];
    for (int j = 0; j < VS; ++j) acc[j] = Vec(0.f);
    const float* qg = q + g * st;
    for (int64_t i = 0; i < nv; ++i) {
      const Vec qv = Vec::loadu(qg + i * VS);
      for (int j = 0; j < VS; ++j) acc[j] = at::vec::fmadd(qv, Vec::loadu(rows[j] + i * VS), acc[j]);
    }
    reduce_rows(acc).store(out + g * ld, n);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// v_accum_rows for GC heads at once: each row is loaded once for the group (not once per head), and every head's
// accumulator sees the same FMAs in the same order as one head at a time (the same bits)
template <int NV, int GC>
void v_accum_rows_g(float* acc, const float* p, int64_t ldp, const float* const* rows, int n) {
  constexpr int NA = GC * NV;
  __m512 a[NA];  // a[g * NV + i]: head g's channels [i * VS, (i + 1) * VS); raw vectors stay in registers
#pragma GCC unroll 32
  for (int i = 0; i < NA; ++i) a[i] = _mm512_loadu_ps(acc + i * VS);
  for (int j = 0; j < n; ++j) {
    __m512 r[NV];
    for (int i = 0; i < NV; ++i) r[i] = _mm512_loadu_ps(rows[j] + i * VS);
    for (int g = 0; g < GC; ++g) {
      const __m512 pj = _mm512_set1_ps(p[g * ldp + j]);
      for (int i = 0; i < NV; ++i) a[g * NV + i] = _mm512_fmadd_ps(pj, r[i], a[g * NV + i]);
    }
  }
#pragma GCC unroll 32
  for (int i = 0; i < NA; ++i) _mm512_storeu_ps(acc + i * VS, a[i]);
}
#endif

// acc[g, :] += sum_{j < n} p[g * ldp + j] * rows[j]
template <int NV>
void v_accum_rows(float* acc, const float* p, int64_t ldp, int64_t G, int64_t nv_rt, const float* const* rows, int n) {
  const int64_t nv = NV > 0 ? NV : nv_rt, st = nv * VS;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (NV > 0 && NV <= 4) {  // the whole group's accumulators in registers (at most 24 of 32)
    switch (G) {
      case 1: return v_accum_rows_g<NV, 1>(acc, p, ldp, rows, n);
      case 2: return v_accum_rows_g<NV, 2>(acc, p, ldp, rows, n);
      case 3: return v_accum_rows_g<NV, 3>(acc, p, ldp, rows, n);
      case 4: return v_accum_rows_g<NV, 4>(acc, p, ldp, rows, n);
      case 5: if constexpr (5 * NV <= 24) return v_accum_rows_g<NV, 5>(acc, p, ldp, rows, n); break;
      case 6: if constexpr (6 * NV <= 24) return v_accum_rows_g<NV, 6>(acc, p, ldp, rows, n); break;
      default: break;
    }
  }
#endif
  if constexpr (NV > 0 && NV <= 8) {
    for (int64_t g = 0; g < G; ++g) {
      const float* pg = p + g * ldp;
      float* ag = acc + g * st;
      Vec a[NV];
      for (int i = 0; i < NV; ++i) a[i] = Vec::loadu(ag + i * VS);
      for (int j = 0; j < n; ++j) {
        const Vec pj(pg[j]);
        const float* rj = rows[j];
        for (int i = 0; i < NV; ++i) a[i] = at::vec::fmadd(pj, Vec::loadu(rj + i * VS), a[i]);
      }
      for (int i = 0; i < NV; ++i) a[i].store(ag + i * VS);
    }
  } else {
    for (int64_t g = 0; g < G; ++g) {
      const float* pg = p + g * ldp;
      float* ag = acc + g * st;
      for (int64_t i = 0; i < nv; ++i) {
        Vec a = Vec::loadu(ag + i * VS);
        for (int j = 0; j < n; ++j) a = at::vec::fmadd(Vec(pg[j]), Vec::loadu(rows[j] + i * VS), a);
        a.store(ag + i * VS);
      }
    }
  }
}

// Bound scores of a block of VS pages from int8 bound codes read in place (rows of D = NV * VS codes, page j's
// at M + j * D and m + j * D), for G query heads at once: r[g * VS + j] = step_j * (relu(qp_g).cM_j +
// min(q_g, 0).cm_j) for j < n (lanes past n are 0), with step_j = int8_step(kab[j]) and cM/cm the codes. The step
// is applied once per page after the sum (the same value as summing decoded rows code * step, up to rounding,
// which the score's slack covers); each row is converted once for all heads, and the two halves of the sum run
// as independent FMA chains. tmp: G * VS * VS floats.
template <int NV, int GC>
inline void bound_block_i8_g(const int8_t* M, const int8_t* m, const float* kab, int n, const float* qp,
                             const float* qn, int64_t G_rt, float* tmp, float* r) {
  constexpr int64_t D = NV * VS;
  const int64_t G = GC > 0 ? GC : G_rt;  // GC > 0: the group size is a constant, so the heads' chains interleave
  for (int j = 0; j < n; ++j) {
    // ---- page j's codes as fp32 (exact), shared by the G heads
    Vec hi[NV], lo[NV];
    for (int i = 0; i < NV; ++i) {
      hi[i] = load_i8(M + j * D + i * VS);
      lo[i] = load_i8(m + j * D + i * VS);
    }
    // ---- per head: relu(q).cM and min(q,0).cm as two chains, one partial-sum row per page
    for (int64_t g = 0; g < G; ++g) {
      const float* a = qp + g * D;
      const float* z = qn + g * D;
      Vec s0 = Vec::loadu(a) * hi[0];
      Vec s1 = Vec::loadu(z) * lo[0];
      for (int i = 1; i < NV; ++i) {
        s0 = at::vec::fmadd(Vec::loadu(a + i * VS), hi[i], s0);
        s1 = at::vec::fmadd(Vec::loadu(z + i * VS), lo[i], s1);
      }
      (s0 + s1).store(tmp + (g * VS + j) * VS);
    }
  }
  for (int j = n; j < VS; ++j)
    for (int64_t g = 0; g < G; ++g) Vec(0.f).store(tmp + (g * VS + j) * VS);
  // ---- the VS page steps (rows past n are 0), then per head the rows reduced to one lane per page, times the step
  const Vec step = int8_step(Vec::loadu(kab, n));
  for (int64_t g = 0; g < G; ++g) {
    Vec rows[VS];
    for (int j = 0; j < VS; ++j) rows[j] = Vec::loadu(tmp + (g * VS + j) * VS);
    (reduce_rows(rows) * step).store(r + g * VS);
  }
}

template <int NV>
void bound_block_i8(const int8_t* M, const int8_t* m, const float* kab, int n, const float* qp, const float* qn,
                    int64_t G, float* tmp, float* r) {
  switch (G) {
    case 1: return bound_block_i8_g<NV, 1>(M, m, kab, n, qp, qn, G, tmp, r);
    case 2: return bound_block_i8_g<NV, 2>(M, m, kab, n, qp, qn, G, tmp, r);
    case 3: return bound_block_i8_g<NV, 3>(M, m, kab, n, qp, qn, G, tmp, r);
    case 4: return bound_block_i8_g<NV, 4>(M, m, kab, n, qp, qn, G, tmp, r);
    default: return bound_block_i8_g<NV, 0>(M, m, kab, n, qp, qn, G, tmp, r);
  }
}

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#define TS_BF16_PAIRS 1
// bfloat16 pairs: one 32-bit lane holds channels 2i (low half) and 2i+1 (high half), so a shift and a mask give
// both as fp32 without shuffles; the query is stored in the same even/odd order (see permute_pairs)
#if defined(CPU_CAPABILITY_AVX512)
inline void bf16_pairs(const c10::BFloat16* p, Vec& even, Vec& odd) {
  const __m512i x = _mm512_loadu_si512(reinterpret_cast<const void*>(p));
  even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#else
inline void bf16_pairs(const c10::BFloat16* p, Vec& even, Vec& odd) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#endif

// bound_block for bfloat16 bounds read in place: rows of D = NC * 2 * VS channels, q in even/odd order
template <int NC>
Vec bound_block_bf16(const c10::BFloat16* M, const c10::BFloat16* m, const float* qp, const float* qn,
                     int64_t nc_rt) {
  const int64_t nc = NC > 0 ? NC : nc_rt, D = nc * 2 * VS;
  Vec acc[VS];
  for (int j = 0; j < VS; ++j) acc[j] = Vec(0.f);
  for (int64_t c = 0; c < nc; ++c) {
    const Vec ae = Vec::loadu(qp + 2 * c * VS), ao = Vec::loadu(qp + (2 * c + 1) * VS);
    const Vec ze = Vec::loadu(qn + 2 * c * VS), zo = Vec::loadu(qn + (2 * c + 1) * VS);
    for (int j = 0; j < VS; ++j) {
      Vec e, o;
      bf16_pairs(M + j * D + c * 2 * VS, e, o);
      acc[j] = at::vec::fmadd(ae, e, acc[j]);
      acc[j] = at::vec::fmadd(ao, o, acc[j]);
      bf16_pairs(m + j * D + c * 2 * VS, e, o);
      acc[j] = at::vec::fmadd(ze, e, acc[j]);
      acc[j] = at::vec::fmadd(zo, o, acc[j]);
    }
  }
  return reduce_rows(acc);
}
// dot and value accumulation on VS bfloat16 rows of D = NC * 2 * VS channels addressed one pointer each (read in
// place, q and the accumulators in even/odd order)
template <int NC>
void dot_rows_bf16(const c10::BFloat16* const* rows, int n, const float* q, int64_t G, int64_t nc_rt, float* out,
                   int64_t ld) {
  const int64_t nc = NC > 0 ? NC : nc_rt, D = nc * 2 * VS;
  for (int64_t g = 0; g < G; ++g) {
    Vec acc[VS];
    for (int j = 0; j < VS; ++j) acc[j] = Vec(0.f);
    const float* qg = q + g * D;
    for (int64_t c = 0; c < nc; ++c) {
      const Vec qe = Vec::loadu(qg + 2 * c * VS), qo = Vec::loadu(qg + (2 * c + 1) * VS);
      for (int j = 0; j < VS; ++j) {
        Vec e, o;
        bf16_pairs(rows[j] + c * 2 * VS, e, o);
        acc[j] = at::vec::fmadd(qe, e, acc[j]);
        acc[j] = at::vec::fmadd(qo, o, acc[j]);
      }
    }
    reduce_rows(acc).store(out + g * ld, n);
  }
}

// v_accum_rows_bf16 for GC heads at once: each row is widened once for the group (not once per head), and every
// head's accumulator sees the same FMAs in the same order as one head at a time (the same bits)
#if defined(CPU_CAPABILITY_AVX512)
template <int NC, int GC>
void v_accum_rows_bf16_g(float* acc, const float* p, int64_t ldp, const c10::BFloat16* const* rows, int n) {
  constexpr int64_t D = NC * 2 * VS;
  constexpr int NA = GC * 2 * NC;
  // raw vectors: GCC keeps an array of at::vec::Vectorized this size in memory, storing it every row
  __m512 a[NA];  // a[g * 2 * NC + i]: head g's channels [i * VS, (i + 1) * VS) in pair order
  // (unrolled here: as a loop GCC makes it a memcpy into a stack array, and the array then stays in memory)
#pragma GCC unroll 32
  for (int i = 0; i < NA; ++i) a[i] = _mm512_loadu_ps(acc + i * VS);
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int j = 0; j < n; ++j) {
    __m512 pj[GC];
    for (int g = 0; g < GC; ++g) pj[g] = _mm512_set1_ps(p[g * ldp + j]);
    for (int cc = 0; cc < NC; ++cc) {
      const __m512i x = _mm512_loadu_si512(reinterpret_cast<const void*>(rows[j] + cc * 2 * VS));
      const __m512 e = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));  // as bf16_pairs
      const __m512 o = _mm512_castsi512_ps(_mm512_and_si512(x, hi));
      for (int g = 0; g < GC; ++g) {
        a[g * 2 * NC + 2 * cc] = _mm512_fmadd_ps(pj[g], e, a[g * 2 * NC + 2 * cc]);
        a[g * 2 * NC + 2 * cc + 1] = _mm512_fmadd_ps(pj[g], o, a[g * 2 * NC + 2 * cc + 1]);
      }
    }
  }
#pragma GCC unroll 32
  for (int i = 0; i < NA; ++i) _mm512_storeu_ps(acc + i * VS, a[i]);
}
#endif

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define TS_DPBF16 1
// Logits of VS bf16 key rows (D = NC * 2 * VS channels, read in place) for G heads from q in bf16, channel order:
// out[g * ld + j] for j < n. vdpbf16ps multiplies channel pairs exactly in fp32 and adds them to the fp32
// accumulators, so where q * scale is exact in bf16 the logits are the fp32 dot products up to the order of the
// additions, with no widening of the keys (the pair kernel widens every row once per head).
template <int NC>
void dot_rows_dpbf16(const c10::BFloat16* const* rows, int n, const c10::BFloat16* q, int64_t G, int64_t nc_rt,
                     float* out, int64_t ld) {
  const int64_t nc = NC > 0 ? NC : nc_rt, D = nc * 2 * VS;
  for (int64_t g = 0; g < G; ++g) {
    __m512 acc[VS];
#pragma GCC unroll 16
    for (int j = 0; j < VS; ++j) acc[j] = _mm512_setzero_ps();
    const c10::BFloat16* qg = q + g * D;
    for (int64_t c = 0; c < nc; ++c) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(qg + c * 2 * VS));
#pragma GCC unroll 16
      for (int j = 0; j < VS; ++j)
        acc[j] = _mm512_dpbf16_ps(
            acc[j], (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(rows[j] + c * 2 * VS)), qv);
    }
    Vec red[VS];
#pragma GCC unroll 16
    for (int j = 0; j < VS; ++j) red[j] = Vec(acc[j]);
    reduce_rows(red).store(out + g * ld, n);
  }
}
#endif

// acc[g] += sum_{j < n} p[g * ldp + j] * rows[j]
template <int NC>
void v_accum_rows_bf16(float* acc, const float* p, int64_t ldp, int64_t G, int64_t nc_rt,
                       const c10::BFloat16* const* rows, int n) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (NC > 0 && NC <= 4) {  // the whole group's accumulators in registers (at most 24 of 32)
    switch (G) {
      case 1: return v_accum_rows_bf16_g<NC, 1>(acc, p, ldp, rows, n);
      case 2: return v_accum_rows_bf16_g<NC, 2>(acc, p, ldp, rows, n);
      case 3: if constexpr (3 * 2 * NC <= 24) return v_accum_rows_bf16_g<NC, 3>(acc, p, ldp, rows, n); break;
      case 4: if constexpr (4 * 2 * NC <= 24) return v_accum_rows_bf16_g<NC, 4>(acc, p, ldp, rows, n); break;
      default: break;
    }
  }
#endif
  const int64_t nc = NC > 0 ? NC : nc_rt, D = nc * 2 * VS;
  for (int64_t g = 0; g < G; ++g) {
    const float* pg = p + g * ldp;
    float* ag = acc + g * D;
    if constexpr (NC > 0 && NC <= 4) {
      Vec a[2 * NC];
      for (int i = 0; i < 2 * NC; ++i) a[i] = Vec::loadu(ag + i * VS);
      for (int j = 0; j < n; ++j) {
        const Vec pj(pg[j]);
        for (int cc = 0; cc < NC; ++cc) {
          Vec e, o;
          bf16_pairs(rows[j] + cc * 2 * VS, e, o);
          a[2 * cc] = at::vec::fmadd(pj, e, a[2 * cc]);
          a[2 * cc + 1] = at::vec::fmadd(pj, o, a[2 * cc + 1]);
        }
      }
      for (int i = 0; i < 2 * NC; ++i) a[i].store(ag + i * VS);
    } else {
      for (int64_t cc = 0; cc < nc; ++cc) {
        Vec ae = Vec::loadu(ag + 2 * cc * VS), ao = Vec::loadu(ag + (2 * cc + 1) * VS);
        for (int j = 0; j < n; ++j) {
          Vec e, o;
          bf16_pairs(rows[j] + cc * 2 * VS, e, o);
          ae = at::vec::fmadd(Vec(pg[j]), e, ae);
          ao = at::vec::fmadd(Vec(pg[j]), o, ao);
        }
        ae.store(ag + 2 * cc * VS);
        ao.store(ag + (2 * cc + 1) * VS);
      }
    }
  }
}
#else
#define TS_BF16_PAIRS 0
#endif

// even/odd order of D = nc * 2 * VS channels: chunk c holds channels 2*VS*c + {0, 2, ..} then {1, 3, ..}
inline void permute_pairs(float* x, int64_t D) {
  float tmp[2 * VS];
  for (int64_t c = 0; c + 2 * VS <= D; c += 2 * VS) {
    for (int l = 0; l < VS; ++l) {
      tmp[l] = x[c + 2 * l];
      tmp[VS + l] = x[c + 2 * l + 1];
    }
    std::memcpy(x + c, tmp, 2 * VS * sizeof(float));
  }
}

struct Kern {
  decltype(&dot_block<0>) dot;
  decltype(&bound_block<0>) bound;
  // the fp32 value sum over rows addressed one pointer each (cache rows read in place, or converted rows)
  decltype(&v_accum_rows<0>) vacc;
  // the row-pointer dot (fp32 rows of D == nv * VS) and the int8 bound kernel (nullptr where nv has none)
  decltype(&dot_rows<0>) dotp = nullptr;
  decltype(&bound_block_i8<1>) bound8 = nullptr;
#if TS_BF16_PAIRS
  // bfloat16 pair kernels, set when D is a multiple of 2 * VS
  decltype(&bound_block_bf16<0>) bound16 = nullptr;
  decltype(&dot_rows_bf16<0>) dot16p = nullptr;
  decltype(&v_accum_rows_bf16<0>) vacc16p = nullptr;
#endif
#if TS_DPBF16
  // logits of bf16 keys from q in bf16 (AVX512-BF16), set when D is a multiple of 2 * VS
  decltype(&dot_rows_dpbf16<0>) dotbf = nullptr;
#endif
  static Kern pick(int64_t nv) {
    Kern k;
    switch (nv) {
      case 1: k = {&dot_block<1>, &bound_block<1>, &v_accum_rows<1>}; break;
      case 2: k = {&dot_block<2>, &bound_block<2>, &v_accum_rows<2>}; break;
      case 4: k = {&dot_block<4>, &bound_block<4>, &v_accum_rows<4>}; break;
      case 8: k = {&dot_block<8>, &bound_block<8>, &v_accum_rows<8>}; break;
      case 16: k = {&dot_block<16>, &bound_block<16>, &v_accum_rows<16>}; break;
      default: k = {&dot_block<0>, &bound_block<0>, &v_accum_rows<0>}; break;
    }
    switch (nv) {
      case 1: k.dotp = &dot_rows<1>; k.bound8 = &bound_block_i8<1>; break;
      case 2: k.dotp = &dot_rows<2>; k.bound8 = &bound_block_i8<2>; break;
      case 4: k.dotp = &dot_rows<4>; k.bound8 = &bound_block_i8<4>; break;
      case 8: k.dotp = &dot_rows<8>; k.bound8 = &bound_block_i8<8>; break;
      default: k.dotp = &dot_rows<0>; break;
    }
#if TS_BF16_PAIRS
    switch (nv) {
      case 2:
        k.bound16 = &bound_block_bf16<1>;
        k.dot16p = &dot_rows_bf16<1>; k.vacc16p = &v_accum_rows_bf16<1>;
        break;
      case 4:
        k.bound16 = &bound_block_bf16<2>;
        k.dot16p = &dot_rows_bf16<2>; k.vacc16p = &v_accum_rows_bf16<2>;
        break;
      case 8:
        k.bound16 = &bound_block_bf16<4>;
        k.dot16p = &dot_rows_bf16<4>; k.vacc16p = &v_accum_rows_bf16<4>;
        break;
      case 16:
        k.bound16 = &bound_block_bf16<8>;
        k.dot16p = &dot_rows_bf16<8>; k.vacc16p = &v_accum_rows_bf16<8>;
        break;
      default:
        if (nv % 2 == 0) {
          k.bound16 = &bound_block_bf16<0>;
          k.dot16p = &dot_rows_bf16<0>;
          k.vacc16p = &v_accum_rows_bf16<0>;
        }
        break;
    }
#endif
#if TS_DPBF16
    switch (nv) {
      case 2: k.dotbf = &dot_rows_dpbf16<1>; break;
      case 4: k.dotbf = &dot_rows_dpbf16<2>; break;
      case 8: k.dotbf = &dot_rows_dpbf16<4>; break;
      default: if (nv % 2 == 0) k.dotbf = &dot_rows_dpbf16<0>; break;
    }
#endif
    return k;
  }
};

// whether bf16 keys and values are read in place as even/odd pairs (then q*scale and the value accumulators are
// in that order)
template <typename T>
inline bool kv_pairs_used(int64_t D) {
  return TS_BF16_PAIRS && std::is_same_v<T, c10::BFloat16> && D % (2 * VS) == 0;
}


// whether bf16 bounds are read in place as even/odd pairs (then qp/qn are stored in that order)
template <typename BT>
inline bool bf16_pairs_used(int64_t D) {
  return TS_BF16_PAIRS && std::is_same_v<BT, c10::BFloat16> && D % (2 * VS) == 0;
}

// A block of n <= VS token rows (tokens tok[0..n), row t at base + t * stride) as VS contiguous fp32 rows of Dp,
// copied into scr (zero rows after n when pad); for rows that are not read in place (fp32 with Dp != D, fp16)
template <typename T>
inline const float* token_block(const T* base, int64_t stride, const int64_t* tok, int n, int64_t D, int64_t Dp,
                                float* scr, bool pad) {
  const T* src[VS];
  for (int j = 0; j < n; ++j) src[j] = base + tok[j] * stride;
  rows_to_f32<T>(src, n, D, Dp, scr);
  if (pad) std::fill(scr + n * Dp, scr + VS * Dp, 0.f);
  return scr;
}

// Logits of a block of n <= VS tokens (rows at base + tok[j] * stride) for G heads: out[g * ld + j].
// bf16 rows are read in place as even/odd pairs when `pairs` (q in pair order), else through fp32 rows; with
// `q16` (q * scale in bf16, channel order, [G, D]) in place by AVX512-BF16 dot products.
template <typename T>
inline void key_dots(const Kern& kern, const T* base, int64_t stride, const int64_t* tok, int n, int64_t D,
                     int64_t Dp, float* scr, const float* q, int64_t G, float* out, int64_t ld, bool pairs,
                     const c10::BFloat16* q16 = nullptr) {
#if TS_BF16_PAIRS
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (pairs) {  // rows read in place (a lane past n reads row 0 again; it is not stored)
      if (n <= 0) return;
      const c10::BFloat16* src[VS];
      for (int j = 0; j < n; ++j) src[j] = base + tok[j] * stride;
      for (int j = n; j < VS; ++j) src[j] = src[0];
#if TS_DPBF16
      if (q16 != nullptr && kern.dotbf != nullptr) {  // q * scale in bf16 (exact): dot products of channel pairs
        kern.dotbf(src, n, q16, G, Dp / (2 * VS), out, ld);
        return;
      }
#endif
      kern.dot16p(src, n, q, G, Dp / (2 * VS), out, ld);
      return;
    }
  }
#endif
  if constexpr (std::is_same_v<T, float>) {
    if (Dp == D) {  // rows read in place (a lane past n reads row 0 again; it is not stored)
      if (n <= 0) return;
      const float* src[VS];
      for (int j = 0; j < n; ++j) src[j] = base + tok[j] * stride;
      for (int j = n; j < VS; ++j) src[j] = src[0];
      kern.dotp(src, n, q, G, Dp / VS, out, ld);
      return;
    }
  }
  const float* rows = token_block<T>(base, stride, tok, n, D, Dp, scr, true);
  kern.dot(rows, n, q, G, Dp / VS, out, ld);
}

// acc[g] += sum_j p[g * ldp + j] * v_j over a block of n <= VS tokens (acc in pair order when `pairs`)
template <typename T>
inline void value_accum(const Kern& kern, const T* base, int64_t stride, const int64_t* tok, int n, int64_t D,
                        int64_t Dp, float* scr, float* acc, const float* p, int64_t ldp, int64_t G, bool pairs) {
#if TS_BF16_PAIRS
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (pairs) {  // rows read in place
      const c10::BFloat16* src[VS];
      for (int j = 0; j < n; ++j) src[j] = base + tok[j] * stride;
      kern.vacc16p(acc, p, ldp, G, Dp / (2 * VS), src, n);
      return;
    }
  }
#endif
  if constexpr (std::is_same_v<T, float>) {
    if (Dp == D) {  // rows read in place
      const float* src[VS];
      for (int j = 0; j < n; ++j) src[j] = base + tok[j] * stride;
      kern.vacc(acc, p, ldp, G, Dp / VS, src, n);
      return;
    }
  }
  // ---- rows converted to fp32 (contiguous, Dp floats each), summed through row pointers
  const float* rows = token_block<T>(base, stride, tok, n, D, Dp, scr, false);
  const float* src[VS];
  for (int j = 0; j < n; ++j) src[j] = rows + j * Dp;
  kern.vacc(acc, p, ldp, G, Dp / VS, src, n);
}

}  // namespace tinyserve_native
