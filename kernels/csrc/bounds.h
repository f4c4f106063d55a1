// The page-bound ops (defined in bounds.cpp).
// Part of the native CPU kernels of tinyserve-compile (overview: sparse_decode.cpp).
#pragma once

#include <ATen/ATen.h>

namespace tinyserve_native {

// every page's bounds from the key cache
void rebuild_bounds(const at::Tensor& k_cache, const at::Tensor& kmax, const at::Tensor& kmin, const at::Tensor& kabs,
                    int64_t page_size);

// index_copy_ of src into the key cache at positions, then the bounds of the touched pages (all when ctrl[0] != 0)
void cache_write(const at::Tensor& k_cache, const at::Tensor& kmax, const at::Tensor& kmin, const at::Tensor& kabs,
                 const at::Tensor& ctrl, const at::Tensor& positions, const at::Tensor& src, int64_t page_size);

}  // namespace tinyserve_native
