// The sparse decode ops (defined in sparse_decode.cpp).
// Part of the native CPU kernels of tinyserve-compile (overview: sparse_decode.cpp).
#pragma once

#include <ATen/ATen.h>

#include "spec.h"

namespace tinyserve_native {

// query-aware paged sparse decode attention of q against the paged KV cache
at::Tensor sparse_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& kmax, const at::Tensor& kmin, const at::Tensor& kabs,
                         const at::Tensor& valid_len, const c10::optional<at::Tensor>& attn_mask, double scale,
                         const Spec& spec, const c10::optional<at::Tensor>& ctrl);

// the pages sparse_decode attends: bool [B, Hkv, P]
at::Tensor kept_pages(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& kmax, const at::Tensor& kmin,
                      const at::Tensor& kabs, const at::Tensor& valid_len, const c10::optional<at::Tensor>& attn_mask,
                      double scale, const Spec& spec, const c10::optional<at::Tensor>& ctrl);

// a page table over a paged buffer [N, Hkv, D]: page p of batch row b starts at buffer row rows[b * stride + p]
// and has the bounds of physical page ids[b * stride + p] (bounds [NP, Hkv, D]); `pages` pages per row
struct PageTable {
  const int64_t* rows = nullptr;
  const int64_t* ids = nullptr;
  int64_t stride = 0, pages = 0;
};

// sparse_decode through a page table: q [B, Hq, 1, D], k_tokens/v_tokens [N, Hkv, D], kmax/kmin [NP, Hkv, D]
// (contiguous), kabs [NP, Hkv], seq_lens int64 [B]; the arguments are checked by the caller (paged.cpp)
at::Tensor sparse_decode_table(const at::Tensor& q, const at::Tensor& k_tokens, const at::Tensor& v_tokens,
                               const at::Tensor& kmax, const at::Tensor& kmin, const at::Tensor& kabs,
                               const at::Tensor& seq_lens, const PageTable& pt, double scale, const Spec& spec);

}  // namespace tinyserve_native
