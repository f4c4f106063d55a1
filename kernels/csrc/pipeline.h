// The sparse decode ops (defined in sparse_decode.cpp).
// Part of the native CPU kernels of tinyserve-compile (overview: sparse_decode.cpp).
#pragma once

#include <ATen/ATen.h>

namespace tinyserve_native {

// query-aware paged sparse decode attention of q against the paged KV cache
at::Tensor sparse_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& kmax, const at::Tensor& kmin, const at::Tensor& kabs,
                         const at::Tensor& valid_len, const c10::optional<at::Tensor>& attn_mask, double scale,
                         int64_t page_size, int64_t token_budget, int64_t sink_pages, int64_t candidate_factor,
                         const c10::optional<at::Tensor>& ctrl, int64_t candidate_extra, bool keep_tokens);

// the pages sparse_decode attends: bool [B, Hkv, P]
at::Tensor kept_pages(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& kmax, const at::Tensor& kmin,
                      const at::Tensor& kabs, const at::Tensor& valid_len, const c10::optional<at::Tensor>& attn_mask,
                      double scale, int64_t page_size, int64_t token_budget, int64_t sink_pages,
                      int64_t candidate_factor, const c10::optional<at::Tensor>& ctrl, int64_t candidate_extra,
                      bool keep_tokens);

}  // namespace tinyserve_native
