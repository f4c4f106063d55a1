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

// Writes the indices of the n_keep largest of w[0, n) to out, ascending, leaving out -inf; ties at the threshold
// go to the lowest indices. Radix select on the float keys (digits of 11/11/10 bits; after the first digit only
// the keys sharing it are scanned), no sort. keys: scratch of 2n. Returns the count.
inline int64_t select_top(const float* w, int64_t n, int64_t n_keep, uint32_t* keys, int32_t* out) {
  constexpr uint32_t NEG_INF_KEY = 0x007FFFFFu;  // fkey(-inf)
  if (n_keep >= n) {
    int64_t cnt = 0;
    for (int64_t p = 0; p < n; ++p)
      if (fkey(w[p]) > NEG_INF_KEY) out[cnt++] = static_cast<int32_t>(p);
    return cnt;
  }
  uint32_t hist[4][2048];
  for (int64_t p = 0; p < n; ++p) keys[p] = fkey(w[p]);
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
  const uint32_t thr = prefix;
  // ---- ascending output: every key above the threshold, the first `need` equal to it
  int64_t cnt = 0;
  for (int64_t p = 0; p < n; ++p) {
    const uint32_t k = keys[p];
    if (k > thr || (k == thr && need-- > 0)) {
      if (k > NEG_INF_KEY) out[cnt++] = static_cast<int32_t>(p);
    }
  }
  return cnt;
}

}  // namespace tinyserve_native
