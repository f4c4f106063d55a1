// The page-bound ops (defined in bounds.cpp).
// Part of the native CPU kernels of tinyserve-compile (overview: sparse_decode.cpp).
#pragma once

#include <ATen/ATen.h>

namespace tinyserve_native {

// every page's bounds from the key cache
void rebuild_bounds(const at::Tensor& k_cache, const at::Tensor& kmax, const at::Tensor& kmin, const at::Tensor& kabs,
                    int64_t page_size);

// ctrl (int32, 2 or kCtrlSize elements; kernels/bounds.py's CTRL_*): the stale flag, the dense-layer flag, and with
// kCtrlSize elements the position after the op's last write (-1: none) and the Triton kernel's arrival counter
constexpr int64_t kCtrlStale = 0, kCtrlEnd = 2, kCtrlSize = 4;

// index_copy_ of src into the key cache at positions, then the bounds of the touched pages; all pages when
// ctrl[kCtrlStale] != 0 or (kCtrlSize elements) when the positions do not start at ctrl[kCtrlEnd], which the write
// then sets to the last position + 1
void cache_write(const at::Tensor& k_cache, const at::Tensor& kmax, const at::Tensor& kmin, const at::Tensor& kabs,
                 const at::Tensor& ctrl, const at::Tensor& positions, const at::Tensor& src, int64_t page_size);

// bounds of n pages of a paged buffer k_tokens [N, Hkv, D]: page j holds rows first_rows[j] .. + n_slots[j] - 1
// (1 <= n_slots[j] <= S) and its bounds go to row ids[j] of kmax/kmin [NP, Hkv, D] and kabs [NP, Hkv] (contiguous);
// the caller checks the rows and ids
void paged_bounds(const at::Tensor& k_tokens, const at::Tensor& kmax, const at::Tensor& kmin, const at::Tensor& kabs,
                  const int64_t* first_rows, const int64_t* n_slots, const int64_t* ids, int64_t n, int64_t S);

}  // namespace tinyserve_native
