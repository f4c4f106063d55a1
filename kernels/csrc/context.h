// The per-call context of sparse_decode: mask view, rows, cache and bounds pointers.
// Part of the native CPU kernels of tinyserve-compile (overview: sparse_decode.cpp).
#pragma once

#include "dtypes.h"
#include "simd.h"

namespace tinyserve_native {

// ------------------------------------------------------------------------------------------------------------
// mask view: attn_mask expanded to [B, Hq, 1, L] and read through its strides
// ------------------------------------------------------------------------------------------------------------

struct MaskView {
  const void* ptr = nullptr;
  int kind = 0;  // 0 none, 1 bool, 2 float32, 3 bfloat16, 4 float16
  int64_t sb = 0, sh = 0, st = 0;
  bool per_head = false;

  inline float at(int64_t b, int64_t hq, int64_t t) const {
    const int64_t off = b * sb + hq * sh + t * st;
    switch (kind) {
      case 1:
        return static_cast<const bool*>(ptr)[off] ? 0.f : NEG_INF;
      case 2:
        return static_cast<const float*>(ptr)[off];
      case 3:
        return static_cast<float>(static_cast<const c10::BFloat16*>(ptr)[off]);
      case 4:
        return static_cast<float>(static_cast<const c10::Half*>(ptr)[off]);
      default:
        return 0.f;
    }
  }
  // max of the additive mask over tokens [t0, t1)
  inline float range_max(int64_t b, int64_t hq, int64_t t0, int64_t t1) const {
    float m = NEG_INF;
    if (kind == 1) {
      const bool* p = static_cast<const bool*>(ptr) + b * sb + hq * sh;
      for (int64_t t = t0; t < t1; ++t)
        if (p[t * st]) return 0.f;
      return NEG_INF;
    }
    for (int64_t t = t0; t < t1; ++t) m = std::max(m, at(b, hq, t));
    return m;
  }
};

inline MaskView make_mask(const c10::optional<at::Tensor>& attn_mask, int64_t B, int64_t Hq, int64_t L) {
  MaskView mv;
  if (!attn_mask.has_value() || !attn_mask->defined()) return mv;
  const at::Tensor& m0 = *attn_mask;
  TORCH_CHECK(m0.device().is_cpu(), "tinyserve (native): attn_mask must be a CPU tensor");
  at::Tensor m = m0;
  while (m.dim() < 4) m = m.unsqueeze(0);
  TORCH_CHECK(m.dim() == 4, "tinyserve (native): attn_mask must broadcast to [B, Hq, 1, L]");
  const bool head_dim = m.size(1) != 1;
  m = m.expand({B, Hq, 1, L});
  mv.ptr = m.data_ptr();
  switch (m.scalar_type()) {
    case at::kBool: mv.kind = 1; break;
    case at::kFloat: mv.kind = 2; break;
    case at::kBFloat16: mv.kind = 3; break;
    case at::kHalf: mv.kind = 4; break;
    default: TORCH_CHECK(false, "tinyserve (native): attn_mask must be bool or floating, got ", m.scalar_type());
  }
  mv.sb = m.stride(0);
  mv.sh = m.stride(1);
  mv.st = m.stride(3);
  mv.per_head = head_dim && Hq > 1;
  return mv;
}

// ------------------------------------------------------------------------------------------------------------
// per-call context
// ------------------------------------------------------------------------------------------------------------

// DENSE: at most max(K, n1) valid pages (every page fits, or is a candidate); TWO_TOPK: n1 of more valid pages
enum RowMode : int { EMPTY = 0, DENSE = 1, ONE_STAGE = 2, TWO_TOPK = 3 };

struct Row {
  int64_t ntok;    // valid tokens, min(valid_len, L)
  int64_t nvalid;  // valid pages, min(ceil(valid_len / S), P)
  int64_t newest;  // page of the newest token, or -1 when that page is past the cache
  int mode;
};

template <typename T, typename BT>
struct Ctx {
  int64_t B, Hq, Hkv, G, L, D, Dp, nv, S, P, K, cf, sinks;
  int64_t n1;        // candidate pages of the first stage, cf * K + candidate_extra / S (two-stage iff n1 > K)
  bool keep_tokens;  // two-stage: keep the K * S candidate tokens of highest share instead of K pages
  float scale, factor, base;
  const T* k;
  int64_t ksb, ksh, ksl;
  const T* v;
  int64_t vsb, vsh, vsl;
  const BT* kmax;
  const BT* kmin;
  const float* kabs;
  MaskView mask;
  const float* qs;    // [B*Hkv, G, Dp] q * scale
  // [B*Hkv, G, D] q * scale as bf16 in channel order, set where bf16 keys' logits take AVX512-BF16 dot products
  // (bf16 keys and q * scale exact in bf16: a bf16 q and a power-of-two scale), else null
  const c10::BFloat16* qs16 = nullptr;
  const float* qp;    // [B*Hkv, G, Dp] max(q, 0)
  const float* qn;    // [B*Hkv, G, Dp] min(q, 0)
  const float* qabs;  // [B*Hkv, G] |q|_1
  std::vector<Row> rows;
  // page table of a paged buffer [N, Hkv, D] (paged_sparse_decode), else null: page p of batch row b starts at
  // buffer row prow[b * pstride + p] and its bounds are those of physical page pid[b * pstride + p]
  const int64_t* prow = nullptr;
  const int64_t* pid = nullptr;
  int64_t pstride = 0;

  // cache row (paged: buffer row) of the first token of page p of batch row b
  inline int64_t page_row(int64_t b, int64_t p) const { return prow ? prow[b * pstride + p] : p * S; }
  // row of the bounds of page p of (batch, KV head) bh: [B * Hkv, P] layout, or [NP, Hkv] by physical page id
  inline int64_t bound_row(int64_t bh, int64_t p) const {
    return pid ? pid[(bh / Hkv) * pstride + p] * Hkv + bh % Hkv : bh * P + p;
  }

  // first row of (batch, KV head) bh; token t is at + t * ksl (resp. vsl)
  inline const T* kbase(int64_t bh) const { return k + (bh / Hkv) * ksb + (bh % Hkv) * ksh; }
  inline const T* vbase(int64_t bh) const { return v + (bh / Hkv) * vsb + (bh % Hkv) * vsh; }
  // q * scale in bf16 of (batch, KV head) bh's G query heads, [G, D], or null
  inline const c10::BFloat16* q16_of(int64_t bh) const { return qs16 ? qs16 + bh * G * D : nullptr; }
  inline bool direct() const { return std::is_same_v<T, float> && Dp == D; }
};

}  // namespace tinyserve_native
