// Partial selection of the largest scores by radix select.
// Part of the native CPU kernels of tinyserve-compile (overview: sparse_decode.cpp).
#pragma once

#include "simd.h"

namespace tinyserve_native {

// ------------------------------------------------------------------------------------------------------------
// partial selection: the n_keep largest of w[0, n), forced pages at +inf, -inf never kept; ascending
// ------------------------------------------------------------------------------------------------------------

// order-preserving map of a float to uint32 (NaN above +inf, as topk treats it as largest)
inline uint32_t fkey(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t k = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return x != x ? 0xFFFFFFFFu : k;
}

// Histogram of digit (k >> sh) & (nb - 1) over the keys with (k & pmask) == prefix; four interleaved
// sub-histograms so that runs of equal digits (scores are concentrated) do not serialise on one counter.
inline void digit_hist(const uint32_t* keys, int64_t n, int sh, uint32_t nb, uint32_t pmask, uint32_t prefix,
                       uint32_t (*hist)[2048]) {
  for (int u = 0; u < 4; ++u) std::memset(hist[u], 0, nb * sizeof(uint32_t));
  int64_t i = 0;
  if (pmask == 0) {
    for (; i + 4 <= n; i += 4)
      for (int u = 0; u < 4; ++u) ++hist[u][(keys[i + u] >> sh) & (nb - 1)];
    for (; i < n; ++i) ++hist[0][(keys[i] >> sh) & (nb - 1)];
  } else {
    for (; i + 4 <= n; i += 4)
      for (int u = 0; u < 4; ++u) hist[u][(keys[i + u] >> sh) & (nb - 1)] += (keys[i + u] & pmask) == prefix;
    for (; i < n; ++i) hist[0][(keys[i] >> sh) & (nb - 1)] += (keys[i] & pmask) == prefix;
  }
  for (uint32_t d = 0; d < nb; ++d) hist[0][d] += hist[1][d] + hist[2][d] + hist[3][d];
}

constexpr uint32_t NEG_INF_KEY = 0x007FFFFFu;  // fkey(-inf)

// The ascending output of select_top once its threshold key thr (the n_keep-th largest) is known: the index of
// every key above it, then of the first keys equal to it until n_keep are out, -inf left out. keys[p] is the key
// of index idx[p] (idx ascending), or of index p when idx is null. Returns the count.
inline int64_t emit_top(const uint32_t* keys, int64_t n, int64_t n_keep, uint32_t thr, int32_t* out,
                        const int32_t* idx = nullptr) {
  int64_t need = n_keep, cnt = 0, p = 0;
#if defined(CPU_CAPABILITY_AVX512)
  // ---- VS keys at a time: the kept lanes (above thr, or among the first `need` equal to it; -inf never) compressed
  // in registers and stored under a mask of their count (a compress straight to memory is slow on some cores)
  const __m512i tv = _mm512_set1_epi32(static_cast<int>(thr)), ninf = _mm512_set1_epi32(NEG_INF_KEY);
  for (; p + 16 <= n; p += 16)
    need -= __builtin_popcount(_mm512_cmpgt_epu32_mask(_mm512_loadu_si512(keys + p), tv));
#endif
  for (int64_t i = p; i < n; ++i) need -= keys[i] > thr;
  p = 0;
#if defined(CPU_CAPABILITY_AVX512)
  __m512i iv = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  for (; p + 16 <= n; p += 16, iv = _mm512_add_epi32(iv, step)) {
    const __m512i k = _mm512_loadu_si512(keys + p);
    uint32_t eq = _mm512_cmpeq_epu32_mask(k, tv);
    if (eq) {  // the first `need` ties in index order
      uint32_t keep = 0;
      for (uint32_t e = eq; e && need > 0; e &= e - 1, --need) keep |= e & (0u - e);
      eq = keep;
    }
    const __mmask16 take =
        static_cast<__mmask16>((_mm512_cmpgt_epu32_mask(k, tv) | eq) & _mm512_cmpgt_epu32_mask(k, ninf));
    if (take == 0) continue;
    const __m512i ix = idx ? _mm512_loadu_si512(idx + p) : iv;
    const int c = __builtin_popcount(static_cast<unsigned>(take));
    _mm512_mask_storeu_epi32(out + cnt, static_cast<__mmask16>((1u << c) - 1), _mm512_maskz_compress_epi32(take, ix));
    cnt += c;
  }
#endif
  for (; p < n; ++p) {
    const uint32_t k = keys[p];
    if (k > thr || (k == thr && need-- > 0)) {
      if (k > NEG_INF_KEY) out[cnt++] = idx ? idx[p] : static_cast<int32_t>(p);
    }
  }
  return cnt;
}

// The keys of keys[0, n) at or above lo, in index order, to sk (keys) and si (indices), while at most cap of them;
// returns their count, or -1 past cap. sk and si hold cap + VS entries (whole vectors are stored).
inline int64_t keys_at_least(const uint32_t* keys, int64_t n, uint32_t lo, int64_t cap, uint32_t* sk, int32_t* si) {
  int64_t m = 0, p = 0;
#if defined(CPU_CAPABILITY_AVX512)
  // compress in registers, then a whole-vector store (a compress straight to memory is slow on some cores)
  const __m512i lov = _mm512_set1_epi32(static_cast<int>(lo));
  const __m512i step = _mm512_set1_epi32(16);
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; p + 16 <= n; p += 16, idx = _mm512_add_epi32(idx, step)) {
    const __m512i k = _mm512_loadu_si512(reinterpret_cast<const void*>(keys + p));
    const __mmask16 hit = _mm512_cmpge_epu32_mask(k, lov);
    if (hit == 0) continue;
    _mm512_storeu_si512(reinterpret_cast<void*>(sk + m), _mm512_maskz_compress_epi32(hit, k));
    _mm512_storeu_si512(reinterpret_cast<void*>(si + m), _mm512_maskz_compress_epi32(hit, idx));
    m += __builtin_popcount(static_cast<unsigned>(hit));
    if (m > cap) return -1;
  }
#endif
  for (; p < n; ++p)
    if (keys[p] >= lo) {
      if (m == cap) return -1;
      sk[m] = keys[p];
      si[m++] = static_cast<int32_t>(p);
    }
  return m;
}

// select_top when the kept share is small: a lower threshold from a strided sample of the keys, the keys at or above
// it (in index order), and the exact threshold among those; -1 (nothing written) when the sample's threshold keeps
// fewer than n_keep keys or more than about n / 3. The result is select_top's: every key at or above the exact
// threshold is at or above the sample's, in the same order.
inline int64_t select_top_sampled(const uint32_t* keys, int64_t n, int64_t n_keep, uint32_t* scratch, int32_t* out) {
  constexpr int NS = 256;
  const int64_t cap = n / 3 - VS;
  uint32_t samp[NS];
  for (int i = 0; i < NS; ++i) samp[i] = keys[static_cast<int64_t>(i) * n / NS];
  // the sample's rank of the kept share, with a margin of 30% + 8 (the fallback covers a miss)
  const int rs = static_cast<int>(std::min<int64_t>(NS - 1, (n_keep * NS * 13 + n * 10 - 1) / (n * 10) + 8));
  std::nth_element(samp, samp + rs, samp + NS, std::greater<uint32_t>());
  uint32_t* sk = scratch;
  int32_t* si = reinterpret_cast<int32_t*>(scratch + cap + VS);
  const int64_t m = keys_at_least(keys, n, samp[rs], cap, sk, si);
  if (m < n_keep) return -1;
  // ---- the n_keep-th largest of the m keys, then the output among them
  uint32_t* tk = scratch + 2 * (cap + VS);
  std::memcpy(tk, sk, m * sizeof(uint32_t));
  std::nth_element(tk, tk + (n_keep - 1), tk + m, std::greater<uint32_t>());
  return emit_top(sk, m, n_keep, tk[n_keep - 1], out, si);
}

// select_top for mid-sized selections: a bracket [lo, hi] around the threshold from a strided sample of the keys,
// one pass that counts the keys above hi and gathers those in the bracket (in index order), and the exact threshold
// among the gathered ones; -1 (nothing written) when the threshold is outside the bracket or more than about n / 3
// keys fall in it. The result is select_top's: the same threshold, then the same output pass.
inline int64_t select_top_bracket(const uint32_t* keys, int64_t n, int64_t n_keep, uint32_t* scratch, int32_t* out) {
  constexpr int NS = 256;
  const int64_t cap = n / 3 - VS;
  uint32_t samp[NS];
  for (int i = 0; i < NS; ++i) samp[i] = keys[static_cast<int64_t>(i) * n / NS];
  // ---- the sample's rank of the threshold, +- 3.5 standard deviations of a binomial count and 4
  const double f = static_cast<double>(n_keep) / static_cast<double>(n);
  const int rs = static_cast<int>(f * NS), mg = static_cast<int>(3.5 * std::sqrt(NS * f * (1.0 - f))) + 4;
  const int ihi = rs - mg, ilo = rs + mg;  // descending ranks; outside [0, NS): no bound on that side
  uint32_t lo = 0, hi = 0xFFFFFFFFu;
  if (ilo < NS) {
    std::nth_element(samp, samp + ilo, samp + NS, std::greater<uint32_t>());
    lo = samp[ilo];
  }
  if (ihi >= 0) {
    std::nth_element(samp, samp + ihi, samp + std::min(ilo, NS), std::greater<uint32_t>());
    hi = samp[ihi];
  }
  // ---- keys above hi counted, keys in [lo, hi] gathered
  uint32_t* sk = scratch;
  int64_t above = 0, m = 0, p = 0;
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i lov = _mm512_set1_epi32(static_cast<int>(lo)), hiv = _mm512_set1_epi32(static_cast<int>(hi));
  for (; p + 16 <= n; p += 16) {
    const __m512i k = _mm512_loadu_si512(keys + p);
    const __mmask16 up = _mm512_cmpgt_epu32_mask(k, hiv);
    const __mmask16 in = _mm512_mask_cmpge_epu32_mask(static_cast<__mmask16>(~up), k, lov);
    above += __builtin_popcount(static_cast<unsigned>(up));
    if (in == 0) continue;
    _mm512_storeu_si512(sk + m, _mm512_maskz_compress_epi32(in, k));
    m += __builtin_popcount(static_cast<unsigned>(in));
    if (m > cap) return -1;
  }
#endif
  for (; p < n; ++p) {
    if (keys[p] > hi) {
      ++above;
    } else if (keys[p] >= lo) {
      if (m == cap) return -1;
      sk[m++] = keys[p];
    }
  }
  if (above >= n_keep || above + m < n_keep) return -1;
  // ---- the (n_keep - above)-th largest of the gathered keys is the threshold
  const int64_t r = n_keep - above;
  std::nth_element(sk, sk + (r - 1), sk + m, std::greater<uint32_t>());
  return emit_top(keys, n, n_keep, sk[r - 1], out);
}

// select_top when all but a few (d = n - n_keep <= 64) are kept: the threshold is the (d + 1)-th smallest key,
// found with a max-heap of the d + 1 smallest (a key at or above its top is passed over, VS keys at a time).
inline int64_t select_top_all_but_few(const uint32_t* keys, int64_t n, int64_t n_keep, int32_t* out) {
  const int64_t h = n - n_keep + 1;
  uint32_t heap[65];
  for (int64_t p = 0; p < h; ++p) heap[p] = keys[p];
  std::make_heap(heap, heap + h);
  int64_t p = h;
#if defined(CPU_CAPABILITY_AVX512)
  for (; p + 16 <= n; p += 16) {
    const __m512i k = _mm512_loadu_si512(reinterpret_cast<const void*>(keys + p));
    __mmask16 lt = _mm512_cmplt_epu32_mask(k, _mm512_set1_epi32(static_cast<int>(heap[0])));
    while (lt) {
      const int i = __builtin_ctz(static_cast<unsigned>(lt));
      lt &= static_cast<__mmask16>(lt - 1);
      if (keys[p + i] < heap[0]) {  // the top may have dropped since the compare
        std::pop_heap(heap, heap + h);
        heap[h - 1] = keys[p + i];
        std::push_heap(heap, heap + h);
      }
    }
  }
#endif
  for (; p < n; ++p)
    if (keys[p] < heap[0]) {
      std::pop_heap(heap, heap + h);
      heap[h - 1] = keys[p];
      std::push_heap(heap, heap + h);
    }
  return emit_top(keys, n, n_keep, heap[0], out);
}

// Writes the indices of the n_keep largest of w[0, n) to out, ascending, leaving out -inf; ties at the threshold
// go to the lowest indices. From n = 4096 where at most a fifth is kept, select_top_sampled; else from n = 512,
// select_top_bracket; where all but at most 64 are kept, select_top_all_but_few; else (or when a sample misses)
// radix select on the float keys (digits of 11/11/10 bits; after the first digit only the keys sharing it are
// scanned), no sort. keys: scratch of 2n. Returns the count. radix_only: the radix select whatever n and n_keep
// (tests compare the paths).
inline int64_t select_top(const float* w, int64_t n, int64_t n_keep, uint32_t* keys, int32_t* out,
                          bool radix_only = false) {
  if (n_keep <= 0) return 0;
  if (n_keep >= n) {
    int64_t cnt = 0;
    for (int64_t p = 0; p < n; ++p)
      if (fkey(w[p]) > NEG_INF_KEY) out[cnt++] = static_cast<int32_t>(p);
    return cnt;
  }
  for (int64_t p = 0; p < n; ++p) keys[p] = fkey(w[p]);
#ifdef TS_RADIX_ONLY
  radix_only = true;
#endif
  if (!radix_only && n >= 4096 && n_keep * 5 <= n) {
    const int64_t cnt = select_top_sampled(keys, n, n_keep, keys + n, out);
    if (cnt >= 0) return cnt;
  }
  if (!radix_only && n >= 512) {
    const int64_t cnt = select_top_bracket(keys, n, n_keep, keys + n, out);
    if (cnt >= 0) return cnt;
  }
  if (!radix_only && n - n_keep <= 64) return select_top_all_but_few(keys, n, n_keep, out);
  uint32_t hist[4][2048];
  // ---- first digit over every key
  digit_hist(keys, n, 21, 2048, 0, 0, hist);
  int64_t need = n_keep;
  uint32_t d = 2047;
  for (;; --d) {
    if (hist[0][d] >= need) break;
    need -= hist[0][d];
  }
  uint32_t prefix = d << 21, pmask = 0xFFE00000u;
  // ---- the keys in that bucket, then the lower digits among them
  uint32_t* sub = keys + n;
  int64_t m = 0;
  for (int64_t p = 0; p < n; ++p) {
    sub[m] = keys[p];
    m += (keys[p] >> 21) == d;
  }
  const int shifts[2] = {10, 0};
  const uint32_t widths[2] = {2048, 1024};
  for (int lvl = 0; lvl < 2; ++lvl) {
    const int sh = shifts[lvl];
    const uint32_t nb = widths[lvl];
    digit_hist(sub, m, sh, nb, pmask, prefix, hist);
    uint32_t e = nb - 1;
    for (;; --e) {
      if (hist[0][e] >= need) break;
      need -= hist[0][e];
    }
    prefix |= e << sh;
    pmask |= (nb - 1) << sh;
  }
  // ---- ascending output: every key above the threshold, the first `need` equal to it
  return emit_top(keys, n, n_keep, prefix, out);
}

}  // namespace tinyserve_native
