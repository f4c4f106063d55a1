// The selection spec of the ops: kernels/spec.py's SelectionSpec, read once from its packed `int[] spec` form.
// Part of the native CPU kernels of tinyserve-compile (overview: sparse_decode.cpp).
#pragma once

#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>

namespace tinyserve_native {

struct Spec {
  // SelectionSpec.to_list(): page_size, token_budget, sink_pages, candidate_factor, candidate_extra, keep_tokens,
  // bounds code
  static constexpr size_t kFields = 7;

  int64_t page_size = 0;
  int64_t token_budget = 0;
  int64_t sink_pages = 0;
  int64_t candidate_factor = 1;
  int64_t candidate_extra = 0;  // tokens
  bool keep_tokens = false;
  int64_t bounds_code = 0;  // kmax/kmin storage (spec.BOUNDS_CODES); the kernels dispatch on the tensors' dtype

  // the one place the packed spec is read
  static Spec from_list(c10::ArrayRef<int64_t> spec) {
    TORCH_CHECK_VALUE(spec.size() == kFields, "argument 'spec' must be ", kFields,
                      " ints (SelectionSpec.to_list()), got ", spec.size());
    Spec s;
    s.page_size = spec[0];
    s.token_budget = spec[1];
    s.sink_pages = spec[2];
    s.candidate_factor = spec[3];
    s.candidate_extra = spec[4];
    s.keep_tokens = spec[5] != 0;
    s.bounds_code = spec[6];
    return s;
  }

  // K: pages kept (SelectionSpec.n_pages)
  int64_t n_pages() const { return token_budget / page_size; }
  // candidate pages of the first stage (SelectionSpec.n_candidates, spec.candidate_pages); two-stage iff > K
  int64_t n_candidates() const { return candidate_factor * n_pages() + candidate_extra / page_size; }
  // a row of at most this many valid pages attends densely (SelectionSpec.n_dense_pages)
  int64_t n_dense_pages() const { return std::max(n_pages(), n_candidates()); }
};

}  // namespace tinyserve_native
