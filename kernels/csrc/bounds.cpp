// Page bounds: cache_write and rebuild_bounds (see sparse_decode.cpp for the overview).

#include "bounds.h"

#include <algorithm>
#include <cstdint>
#include "dtypes.h"
#include "pool.h"
#include "simd.h"

namespace tinyserve_native {
namespace {

// ------------------------------------------------------------------------------------------------------------
// page bounds
// ------------------------------------------------------------------------------------------------------------

// bfloat16 rounded outward: up for the max, down for the min (the score stays an upper bound)
inline float round_up_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if ((bits & 0xFFFFu) == 0) return x;
  if (x > 0.f)
    bits = (bits + 0x10000u) & 0xFFFF0000u;
  else
    bits &= 0xFFFF0000u;
  float y;
  std::memcpy(&y, &bits, 4);
  return y;
}
inline float round_down_bf16(float x) { return -round_up_bf16(-x); }

// int8 code c in [-127, 127]: the smallest c with c * step >= x (up) or the largest with c * step <= x
// (reference._int8_codes). The division is rounded once, so ceil/floor is off by at most one either way: one
// check of each neighbour corrects it. fp32 throughout; NaN gives 0 (as torch's clamp then cast on x86), +-inf
// saturate.
inline int8_t int8_code(float x, float step, bool up) {
  float c = up ? std::ceil(x / step) : std::floor(x / step);
  if (up) {
    if ((c - 1.f) * step >= x) c -= 1.f;
    if (c * step < x) c += 1.f;
  } else {
    if ((c + 1.f) * step <= x) c += 1.f;
    if (c * step > x) c -= 1.f;
  }
  if (std::isnan(c)) return 0;
  return static_cast<int8_t>(std::min(127.f, std::max(-127.f, c)));
}

// bounds of pages [p0, p1) of one (batch, KV head), every slot of a page inside the cache
template <typename T, typename BT>
void bound_pages(const T* kb, int64_t ksl, int64_t L, int64_t D, int64_t S, int64_t p0, int64_t p1, BT* M, BT* m,
                 float* kab) {
  float* hi = scratch_f<8>(2 * D);
  float* lo = hi + D;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t t0 = p * S, t1 = std::min(t0 + S, L);
    // ---- channel-wise max and min (NaN propagates, as amax/amin)
    {
      const T* r = kb + t0 * ksl;
      int64_t i = 0;
      for (; i + VS <= D; i += VS) loadf(r + i).store(hi + i);
      for (; i < D; ++i) hi[i] = static_cast<float>(r[i]);
      std::memcpy(lo, hi, D * sizeof(float));
    }
    for (int64_t t = t0 + 1; t < t1; ++t) {
      const T* r = kb + t * ksl;
      int64_t i = 0;
      for (; i + VS <= D; i += VS) {
        const Vec x = loadf(r + i);
        at::vec::maximum(Vec::loadu(hi + i), x).store(hi + i);
        at::vec::minimum(Vec::loadu(lo + i), x).store(lo + i);
      }
      for (; i < D; ++i) {
        const float x = static_cast<float>(r[i]);
        hi[i] = (std::isnan(x) || x > hi[i]) ? x : hi[i];
        lo[i] = (std::isnan(x) || x < lo[i]) ? x : lo[i];
      }
    }
    if constexpr (std::is_same_v<BT, int8_t>) {
      // ---- int8: kabs = the exact max |k| of the page, then the codes on its grid (reference.store_bounds)
      float a = 0.f;
      bool nan = false;
      for (int64_t i = 0; i < D; ++i) {
        const float ab = std::max(std::fabs(hi[i]), std::fabs(lo[i]));
        nan |= std::isnan(ab);
        a = std::max(a, ab);
      }
      if (nan) a = std::numeric_limits<float>::quiet_NaN();
      const float step = int8_step(a);
      for (int64_t i = 0; i < D; ++i) {
        M[p * D + i] = int8_code(hi[i], step, true);
        m[p * D + i] = int8_code(lo[i], step, false);
      }
      kab[p] = a;
      continue;
    }
    // ---- stored format, then kabs from the stored values
    float a = 0.f;
    bool nan = false;
    for (int64_t i = 0; i < D; ++i) {
      float x = hi[i], y = lo[i];
      if constexpr (std::is_same_v<BT, c10::BFloat16>) {
        x = round_up_bf16(x);
        y = round_down_bf16(y);
        M[p * D + i] = c10::BFloat16(x);  // exact: low 16 bits are zero
        m[p * D + i] = c10::BFloat16(y);
      } else if constexpr (std::is_same_v<BT, float>) {
        M[p * D + i] = x;
        m[p * D + i] = y;
      }
      const float ab = std::max(std::fabs(x), std::fabs(y));
      nan |= std::isnan(ab);
      a = std::max(a, ab);
    }
    kab[p] = nan ? std::numeric_limits<float>::quiet_NaN() : a;
  }
}

void check_bounds_args(const at::Tensor& k, const at::Tensor& kmax, const at::Tensor& kmin, const at::Tensor& kabs,
                       int64_t S) {
  TORCH_CHECK(S > 0, "tinyserve (native): page_size must be positive");
  TORCH_CHECK(k.dim() == 4 && k.device().is_cpu(), "tinyserve (native): k_cache must be a CPU [B, Hkv, L, D] tensor");
  TORCH_CHECK(k.size(3) == 0 || k.stride(3) == 1, "tinyserve (native): k_cache needs a unit stride on D");
  const int64_t P = (k.size(2) + S - 1) / S;
  TORCH_CHECK(kmax.dim() == 4 && kmax.size(0) == k.size(0) && kmax.size(1) == k.size(1) && kmax.size(2) == P &&
                  kmax.size(3) == k.size(3) && kmin.sizes() == kmax.sizes() && kmax.is_contiguous() &&
                  kmin.is_contiguous(),
              "tinyserve (native): kmax/kmin must be contiguous [B, Hkv, P, D]");
  TORCH_CHECK(kmax.scalar_type() == kmin.scalar_type() &&
                  (kmax.scalar_type() == at::kFloat || kmax.scalar_type() == at::kBFloat16 ||
                   kmax.scalar_type() == at::kChar),
              "tinyserve (native): kmax/kmin must be float32, bfloat16 or int8");
  TORCH_CHECK(kabs.dim() == 3 && kabs.size(0) == k.size(0) && kabs.size(1) == k.size(1) && kabs.size(2) == P &&
                  kabs.scalar_type() == at::kFloat && kabs.is_contiguous(),
              "tinyserve (native): kabs must be contiguous float32 [B, Hkv, P]");
}

// k_cache[:, :, pos[i]] = src[:, :, i] row by row when src is [B, Hkv, n, D] of the cache's dtype with a unit
// stride on D (a decode step's write; ATen's index_copy_ costs several microseconds more per call); false (nothing
// written) for any other src, which index_copy_ then takes. pos: int64, every entry inside the cache (checked).
bool copy_rows(const at::Tensor& k, const at::Tensor& pos, const at::Tensor& src) {
  const int64_t B = k.size(0), H = k.size(1), D = k.size(3), n = pos.numel();
  if (src.scalar_type() != k.scalar_type() || src.dim() != 4 || !src.device().is_cpu() || src.size(0) != B ||
      src.size(1) != H || src.size(2) != n || src.size(3) != D || (D > 1 && src.stride(3) != 1) ||
      !pos.is_contiguous())
    return false;
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t bytes = D * k.element_size();
  char* kd = static_cast<char*>(k.data_ptr());
  const char* sd = static_cast<const char*>(src.data_ptr());
  const int64_t es = k.element_size();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < n; ++i)
        std::memcpy(kd + (b * k.stride(0) + h * k.stride(1) + pp[i] * k.stride(2)) * es,
                    sd + (b * src.stride(0) + h * src.stride(1) + i * src.stride(2)) * es, bytes);
  return true;
}

// pages: ascending page list, or nullptr for every page
void bounds_for_pages(const at::Tensor& k, const at::Tensor& kmax, const at::Tensor& kmin, const at::Tensor& kabs,
                      int64_t S, const std::vector<int64_t>* pages) {
  const int64_t B = k.size(0), H = k.size(1), L = k.size(2), D = k.size(3), P = (L + S - 1) / S;
  if (B * H == 0 || P == 0) return;
  dispatch_kv(k.scalar_type(), "tinyserve.bounds (native)", [&](auto tag) {
    using T = decltype(tag);
    auto body = [&](auto* Mp, auto* mp) {
      using BT = std::remove_pointer_t<decltype(Mp)>;
      const T* kd = k.data_ptr<T>();
      float* ka = kabs.data_ptr<float>();
      const int64_t sb = k.stride(0), sh = k.stride(1), sl = k.stride(2);
      if (pages == nullptr) {
        const int64_t ch = std::max<int64_t>(16, (P + 3) / 4);
        const int64_t nch = (P + ch - 1) / ch;
        run_items(B * H * nch, [&](int64_t i) {
          const int64_t bh = i / nch, c0 = (i % nch) * ch;
          const T* kb = kd + (bh / H) * sb + (bh % H) * sh;
          bound_pages<T, BT>(kb, sl, L, D, S, c0, std::min(P, c0 + ch), Mp + bh * P * D, mp + bh * P * D,
                             ka + bh * P);
        });
      } else {
        const int64_t np = static_cast<int64_t>(pages->size());
        if (np == 0) return;
        auto one = [&](int64_t i) {
          const int64_t bh = i / np, p = (*pages)[i % np];
          const T* kb = kd + (bh / H) * sb + (bh % H) * sh;
          bound_pages<T, BT>(kb, sl, L, D, S, p, p + 1, Mp + bh * P * D, mp + bh * P * D, ka + bh * P);
        };
        if (B * H * np * S * D < (1 << 16)) {
          for (int64_t i = 0; i < B * H * np; ++i) one(i);  // a decode step: too little work to fork
        } else {
          run_items(B * H * np, one);
        }
      }
    };
    dispatch_bt(kmax.scalar_type(), "tinyserve.bounds (native)", [&](auto btag) {
      using BT = decltype(btag);
      body(kmax.data_ptr<BT>(), kmin.data_ptr<BT>());
    });
  });
}

}  // namespace

void rebuild_bounds(const at::Tensor& k_cache, const at::Tensor& kmax, const at::Tensor& kmin, const at::Tensor& kabs,
                    int64_t page_size) {
  check_bounds_args(k_cache, kmax, kmin, kabs, page_size);
  bounds_for_pages(k_cache, kmax, kmin, kabs, page_size, nullptr);
}

void cache_write(const at::Tensor& k_cache, const at::Tensor& kmax, const at::Tensor& kmin, const at::Tensor& kabs,
                 const at::Tensor& ctrl, const at::Tensor& positions, const at::Tensor& src, int64_t page_size) {
  check_bounds_args(k_cache, kmax, kmin, kabs, page_size);
  TORCH_CHECK(ctrl.device().is_cpu() && ctrl.scalar_type() == at::kInt && ctrl.numel() >= 1 && ctrl.is_contiguous(),
              "tinyserve.cache_write (native): ctrl must be a contiguous int32 CPU tensor");
  TORCH_CHECK_VALUE(k_cache.size(2) <= INT32_MAX, "tinyserve.cache_write: the cache's ", k_cache.size(2),
                    " slots exceed int32 positions");
  TORCH_CHECK_VALUE(at::isIntegralType(positions.scalar_type(), /*includeBool=*/false),
                    "tinyserve.cache_write: argument 'positions' must be an integer tensor, got ",
                    positions.scalar_type());
  // ---- the write itself (positions: 0-d, [1] or [n], any integer dtype)
  at::Tensor pos = positions.reshape({-1}).to(at::kLong).contiguous();
  {  // every position inside the cache before anything is written (index_copy_ may write some, then raise)
    const int64_t L = k_cache.size(2), *pp = pos.data_ptr<int64_t>();
    for (int64_t i = 0; i < pos.numel(); ++i)
      TORCH_CHECK_INDEX(pp[i] >= 0 && pp[i] < L, "tinyserve.cache_write: argument 'positions' holds ", pp[i],
                        ", outside the cache's ", L, " slots");
  }
  if (!copy_rows(k_cache, pos, src)) {
    at::Tensor kc = k_cache;
    kc.index_copy_(2, pos, src);
  }
  // ---- bounds: everything when flagged stale or the positions do not go on from the last write, else the
  //      touched pages
  int32_t* flag = ctrl.data_ptr<int32_t>();
  const int64_t n = pos.numel(), *pp = pos.data_ptr<int64_t>();
  bool stale = flag[kCtrlStale] != 0;
  if (ctrl.numel() >= kCtrlSize && n > 0) {  // the end of the last write: positions must go on from it
    const auto [lo, hi] = std::minmax_element(pp, pp + n);
    stale = stale || *lo != flag[kCtrlEnd];
    flag[kCtrlEnd] = static_cast<int32_t>(*hi + 1);  // positions are below L <= INT32_MAX (checked)
  }
  if (stale) {
    bounds_for_pages(k_cache, kmax, kmin, kabs, page_size, nullptr);
    flag[kCtrlStale] = 0;
    return;
  }
  const int64_t P = kmax.size(2);
  std::vector<int64_t> pages;
  pages.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = pp[i] >= 0 ? pp[i] / page_size : -1;
    if (p >= 0 && p < P) pages.push_back(p);
  }
  std::sort(pages.begin(), pages.end());
  pages.erase(std::unique(pages.begin(), pages.end()), pages.end());
  bounds_for_pages(k_cache, kmax, kmin, kabs, page_size, &pages);
}

void paged_bounds(const at::Tensor& k_tokens, const at::Tensor& kmax, const at::Tensor& kmin, const at::Tensor& kabs,
                  const int64_t* first_rows, const int64_t* n_slots, const int64_t* ids, int64_t n, int64_t S) {
  const int64_t H = k_tokens.size(1), D = k_tokens.size(2);
  if (n == 0 || H == 0) return;
  dispatch_kv(k_tokens.scalar_type(), "tinyserve.paged_bounds (native)", [&](auto tag) {
    using T = decltype(tag);
    dispatch_bt(kmax.scalar_type(), "tinyserve.paged_bounds (native)", [&](auto btag) {
      using BT = decltype(btag);
      const T* kd = k_tokens.data_ptr<T>();
      BT* Mp = kmax.data_ptr<BT>();
      BT* mp = kmin.data_ptr<BT>();
      float* ka = kabs.data_ptr<float>();
      const int64_t sr = k_tokens.stride(0), sh = k_tokens.stride(1);
      // one (page, KV head): the page read as page 0 of a cache of n_slots tokens starting at its first row
      auto one = [&](int64_t i) {
        const int64_t j = i / H, h = i % H, row = ids[j] * H + h;
        bound_pages<T, BT>(kd + first_rows[j] * sr + h * sh, sr, n_slots[j], D, S, 0, 1, Mp + row * D, mp + row * D,
                           ka + row);
      };
      if (n * H * S * D < (1 << 16)) {
        for (int64_t i = 0; i < n * H; ++i) one(i);  // a decode step: too little work to fork
      } else {
        run_items(n * H, one);
      }
    });
  });
}

}  // namespace tinyserve_native
