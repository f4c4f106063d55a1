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

  // the largest value of every integer field (spec.MAX_INDEX): page and token indices are 32-bit, and
  // candidate_factor * K of two such fields cannot overflow int64
  static constexpr int64_t kMaxIndex = (int64_t(1) << 31) - 1;
  // the largest page (spec.MAX_PAGE_SIZE)
  static constexpr int64_t kMaxPageSize = 1024;

  // the one place the packed spec is read; each field is checked against its range, as SelectionSpec.check does
  static Spec from_list(c10::ArrayRef<int64_t> spec) {
    TORCH_CHECK_VALUE(spec.size() == kFields, "argument 'spec' must be ", kFields,
                      " ints (SelectionSpec.to_list()), got ", spec.size());
    Spec s;
    s.page_size = check(spec[0], 1, kMaxPageSize, "page_size");
    s.token_budget = check(spec[1], s.page_size, kMaxIndex, "token_budget");
    s.sink_pages = check(spec[2], 0, s.n_pages() - 1, "sink_pages");
    s.candidate_factor = check(spec[3], 1, kMaxIndex, "candidate_factor");
    s.candidate_extra = check(spec[4], 0, kMaxIndex, "candidate_extra");
    s.keep_tokens = spec[5] != 0;
    s.bounds_code = spec[6];
    return s;
  }

  // this spec with its sizes bounded by a cache of P pages, selecting the same (SelectionSpec.for_cache): a spec
  // whose dense rule covers every page attends every row densely, as a budget of the whole cache does
  Spec for_cache(int64_t P) const {
    P = std::max<int64_t>(P, 1);
    if (n_dense_pages() < P) return *this;
    Spec s = *this;
    s.token_budget = P * page_size;
    s.sink_pages = std::min(sink_pages, P - 1);
    s.candidate_factor = 1;
    s.candidate_extra = 0;
    return s;
  }

  // K: pages kept (SelectionSpec.n_pages)
  int64_t n_pages() const { return token_budget / page_size; }
  // candidate pages of the first stage (SelectionSpec.n_candidates, spec.candidate_pages); two-stage iff > K
  int64_t n_candidates() const { return candidate_factor * n_pages() + candidate_extra / page_size; }
  // a row of at most this many valid pages attends densely (SelectionSpec.n_dense_pages)
  int64_t n_dense_pages() const { return std::max(n_pages(), n_candidates()); }

 private:
  static int64_t check(int64_t v, int64_t lo, int64_t hi, const char* name) {
    TORCH_CHECK_VALUE(lo <= v && v <= hi, "selection spec: argument '", name, "' must be an int in [", lo, ", ", hi,
                      "], got ", v);
    return v;
  }
};

}  // namespace tinyserve_native
