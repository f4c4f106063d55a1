// The paged ops of continuous batching (defined in paged.cpp).
// Part of the native CPU kernels of tinyserve-compile (overview: sparse_decode.cpp).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include "spec.h"

namespace tinyserve_native {

// sparse decode of rows q [R, Hq, 1, D] over a paged buffer k_tokens/v_tokens [N, Hkv, D] through their page tables
// (page_rows/page_ids int64 [R, P], seq_lens int64 [R]), bounds kmax/kmin [NP, Hkv, D], kabs [NP, Hkv]
at::Tensor paged_sparse_decode(const at::Tensor& q, const at::Tensor& k_tokens, const at::Tensor& v_tokens,
                               const at::Tensor& page_rows, const at::Tensor& page_ids, const at::Tensor& seq_lens,
                               const at::Tensor& kmax, const at::Tensor& kmin, const at::Tensor& kabs, double scale,
                               const Spec& spec);

// write key/value [T, Hkv, D] at buffer rows write_rows [T], rebuild the bounds of the touched pages, mark them fresh;
// returns their physical ids, int64 [n] ascending
at::Tensor paged_write(const at::Tensor& k_tokens, const at::Tensor& v_tokens, const at::Tensor& key,
                       const at::Tensor& value, const at::Tensor& write_rows, const at::Tensor& kmax,
                       const at::Tensor& kmin, const at::Tensor& kabs, const at::Tensor& fresh, int64_t page_size,
                       int64_t rows_per_block, int64_t pages_per_block);

// bounds of pages (first buffer row, valid slots, physical id) rebuilt from the buffer
void paged_bounds_rebuild(const at::Tensor& k_tokens, const at::Tensor& kmax, const at::Tensor& kmin,
                          const at::Tensor& kabs, const at::Tensor& first_rows, const at::Tensor& n_slots,
                          const at::Tensor& page_ids, int64_t page_size);

// make the native kernel the CPU kernel of tinyserve::paged_sparse_decode; python_kernel(same arguments) runs the
// choices of the `kernel` argument other than "auto" and "native"
void register_paged_cpu_kernel(pybind11::object python_kernel);

}  // namespace tinyserve_native
