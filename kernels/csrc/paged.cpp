// Paged sparse decode and paged bound writes: the native CPU kernels of continuous batching's paged KV buffer.
// Part of the native CPU kernels of tinyserve-compile (overview: sparse_decode.cpp).
//
//   paged_sparse_decode  one call per sparse layer and decode step of a continuous-batching engine: each decode row
//                        reads its own page table (first buffer row and physical id of each page, its length) and
//                        runs the static op's pipeline (sparse_decode.cpp: bound scan, selection, two-stage
//                        ranking, exact attention) through that table, reading the flat buffer [N, Hkv, D] in place
//   paged_write          the write of new keys and values into the buffer, then the bounds of every page it touches
//                        rebuilt over slots 0..s (s: the highest slot written), keyed by physical page id
//   paged_bounds_rebuild the bounds of listed pages over their first n slots (stale pages)
//
// The semantics are those of kernels/paged_sparse_decode.py (paged_sparse_decode_reference, paged_write_,
// paged_page_bounds). Every page-table entry a call reads is checked against the buffer and the bounds first.

#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <memory>
#include <string>
#include <vector>

#include "bounds.h"
#include "dispatch.h"
#include "paged.h"
#include "pipeline.h"

namespace tinyserve_native {
namespace {

void check_buffer(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == 3 && t.device().is_cpu(), "tinyserve.paged (native): argument '", name,
                    "' must be a CPU [N, Hkv, D] tensor, got ", t.sizes());
  TORCH_CHECK_VALUE(t.size(2) == 0 || t.stride(2) == 1, "tinyserve.paged (native): argument '", name,
                    "' needs a unit stride on D");
}

void check_bounds(const at::Tensor& kmax, const at::Tensor& kmin, const at::Tensor& kabs, int64_t H, int64_t D) {
  TORCH_CHECK_VALUE(kmax.dim() == 3 && kmax.size(1) == H && kmax.size(2) == D && kmin.sizes() == kmax.sizes() &&
                        kmax.is_contiguous() && kmin.is_contiguous() && kmax.device().is_cpu() &&
                        kmin.device().is_cpu(),
                    "tinyserve.paged (native): arguments 'kmax'/'kmin' must be contiguous CPU [NP, Hkv=", H, ", D=", D,
                    "], got ", kmax.sizes(), " and ", kmin.sizes());
  TORCH_CHECK_VALUE(kmax.scalar_type() == kmin.scalar_type() &&
                        (kmax.scalar_type() == at::kFloat || kmax.scalar_type() == at::kBFloat16 ||
                         kmax.scalar_type() == at::kChar),
                    "tinyserve.paged (native): arguments 'kmax'/'kmin' must be float32, bfloat16 or int8");
  TORCH_CHECK_VALUE(kabs.dim() == 2 && kabs.size(0) == kmax.size(0) && kabs.size(1) == H &&
                        kabs.scalar_type() == at::kFloat && kabs.is_contiguous() && kabs.device().is_cpu(),
                    "tinyserve.paged (native): argument 'kabs' must be contiguous float32 CPU [NP, Hkv], got ",
                    kabs.sizes());
}

at::Tensor long_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && at::isIntegralType(t.scalar_type(), /*includeBool=*/false),
                    "tinyserve.paged (native): argument '", name, "' must be an integer CPU tensor, got ",
                    t.scalar_type(), " on ", t.device());
  return t.to(at::kLong).contiguous();
}

// the Python kernel of tinyserve::paged_sparse_decode: runs the `kernel` choices other than "auto" and "native"
pybind11::object* fallback = nullptr;

at::Tensor paged_sparse_decode_cpu(const at::Tensor& q, const at::Tensor& k_tokens, const at::Tensor& v_tokens,
                                   const at::Tensor& page_rows, const at::Tensor& page_ids, const at::Tensor& seq_lens,
                                   const at::Tensor& kmax, const at::Tensor& kmin, const at::Tensor& kabs, double scale,
                                   c10::ArrayRef<int64_t> spec, c10::string_view kernel) {
  // a malformed spec goes to the Python kernel too, whose SelectionSpec.from_list names what is wrong
  if ((kernel == "auto" || kernel == "native") && spec.size() == Spec::kFields) {
    return paged_sparse_decode(q, k_tokens, v_tokens, page_rows, page_ids, seq_lens, kmax, kmin, kabs, scale,
                               Spec::from_list(spec));
  }
  pybind11::gil_scoped_acquire gil;
  pybind11::object out = (*fallback)(q, k_tokens, v_tokens, page_rows, page_ids, seq_lens, kmax, kmin, kabs, scale,
                                     std::vector<int64_t>(spec.begin(), spec.end()), std::string(kernel));
  return out.cast<at::Tensor>();
}

}  // namespace

at::Tensor paged_sparse_decode(const at::Tensor& q, const at::Tensor& k_tokens, const at::Tensor& v_tokens,
                               const at::Tensor& page_rows, const at::Tensor& page_ids, const at::Tensor& seq_lens,
                               const at::Tensor& kmax, const at::Tensor& kmin, const at::Tensor& kabs, double scale,
                               const Spec& spec) {
  // ---- shapes, dtypes, selection arguments
  TORCH_CHECK_VALUE(q.dim() == 4 && q.size(2) == 1 && q.device().is_cpu(),
                    "tinyserve.paged_sparse_decode (native): argument 'q' must be a CPU [R, Hq, 1, D] tensor, got ",
                    q.sizes());
  check_buffer(k_tokens, "k_tokens");
  check_buffer(v_tokens, "v_tokens");
  // the key and value views of an engine's cache may hold different numbers of rows: a row must be in both
  const int64_t R = q.size(0), Hq = q.size(1), D = q.size(3), H = k_tokens.size(1);
  const int64_t N = std::min(k_tokens.size(0), v_tokens.size(0));
  TORCH_CHECK_VALUE(v_tokens.size(1) == H && v_tokens.size(2) == D && k_tokens.size(2) == D && H > 0 && Hq % H == 0,
                    "tinyserve.paged_sparse_decode (native): arguments 'k_tokens'/'v_tokens' must be [N, Hkv, D=", D,
                    "] with Hkv dividing Hq=", Hq, ", got ", k_tokens.sizes(), " and ", v_tokens.sizes());
  TORCH_CHECK_VALUE(k_tokens.scalar_type() == q.scalar_type() && v_tokens.scalar_type() == q.scalar_type(),
                    "tinyserve.paged_sparse_decode (native): arguments 'k_tokens'/'v_tokens' must have q's dtype ",
                    q.scalar_type());
  check_bounds(kmax, kmin, kabs, H, D);
  const int64_t S = spec.page_size;
  TORCH_CHECK_VALUE(S > 0 && spec.token_budget >= S && spec.sink_pages >= 0 && spec.candidate_factor >= 1 &&
                        spec.candidate_extra >= 0 && scale > 0,
                    "tinyserve.paged_sparse_decode (native): bad selection arguments (page_size=", S,
                    ", token_budget=", spec.token_budget, ", sink_pages=", spec.sink_pages, ", candidate_factor=",
                    spec.candidate_factor, ", candidate_extra=", spec.candidate_extra, ", scale=", scale, ")");
  TORCH_CHECK_VALUE(page_rows.dim() == 2 && page_ids.sizes() == page_rows.sizes() && page_rows.size(0) == R,
                    "tinyserve.paged_sparse_decode (native): arguments 'page_rows' and 'page_ids' must be [R=", R,
                    ", P] of one shape, got ", page_rows.sizes(), " and ", page_ids.sizes());
  TORCH_CHECK_VALUE(seq_lens.dim() == 1 && seq_lens.size(0) == R,
                    "tinyserve.paged_sparse_decode (native): argument 'seq_lens' must be [R=", R, "], got ",
                    seq_lens.sizes());
  const at::Tensor rows = long_cpu(page_rows, "page_rows"), ids = long_cpu(page_ids, "page_ids");
  const at::Tensor lens = long_cpu(seq_lens, "seq_lens");
  const int64_t P = rows.size(1), NP = kmax.size(0);
  // ---- every page a row reads lies inside the buffer and has a bound
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t L = lp[r];
    TORCH_CHECK_VALUE(L >= 0 && L <= P * S, "tinyserve.paged_sparse_decode (native): argument 'seq_lens' has ", L,
                      " tokens at row ", r, ", outside [0, ", P * S, "] (P=", P, " pages of ", S, ")");
    for (int64_t p = 0; p * S < L; ++p) {
      const int64_t row = rp[r * P + p], id = ip[r * P + p], n = std::min(S, L - p * S);
      TORCH_CHECK_VALUE(row >= 0 && row + n <= N, "tinyserve.paged_sparse_decode (native): argument 'page_rows' [",
                        r, ", ", p, "] = ", row, " puts ", n, " tokens outside the buffer of ", N, " rows");
      TORCH_CHECK_VALUE(id >= 0 && id < NP, "tinyserve.paged_sparse_decode (native): argument 'page_ids' [", r, ", ",
                        p, "] = ", id, " is not a page of the bounds (", NP, " pages)");
    }
  }
  if (R == 0 || Hq == 0 || D == 0) return at::zeros_like(q, q.options().memory_format(at::MemoryFormat::Contiguous));
  // ---- the static op's pipeline through the page table
  PageTable pt;
  pt.rows = rp;
  pt.ids = ip;
  pt.stride = P;
  pt.pages = P;
  return sparse_decode_table(q, k_tokens, v_tokens, kmax, kmin, kabs, lens, pt, scale, spec);
}

at::Tensor paged_write(const at::Tensor& k_tokens, const at::Tensor& v_tokens, const at::Tensor& key,
                       const at::Tensor& value, const at::Tensor& write_rows, const at::Tensor& kmax,
                       const at::Tensor& kmin, const at::Tensor& kabs, const at::Tensor& fresh, int64_t page_size,
                       int64_t rows_per_block, int64_t pages_per_block) {
  check_buffer(k_tokens, "k_tokens");
  check_buffer(v_tokens, "v_tokens");
  const int64_t N = k_tokens.size(0), H = k_tokens.size(1), D = k_tokens.size(2), S = page_size;
  check_bounds(kmax, kmin, kabs, H, D);
  const int64_t NP = kmax.size(0);
  TORCH_CHECK_VALUE(S > 0 && rows_per_block > 0 && pages_per_block > 0 && pages_per_block * S <= rows_per_block,
                    "tinyserve.paged_write (native): bad layout (page_size=", S, ", rows_per_block=", rows_per_block,
                    ", pages_per_block=", pages_per_block, ")");
  TORCH_CHECK_VALUE(fresh.dim() == 1 && fresh.size(0) == NP && fresh.scalar_type() == at::kBool &&
                        fresh.is_contiguous() && fresh.device().is_cpu(),
                    "tinyserve.paged_write (native): argument 'fresh' must be a contiguous bool CPU [NP=", NP,
                    "] tensor");
  const at::Tensor w = long_cpu(write_rows, "write_rows").reshape({-1});
  const int64_t T = w.numel();
  const int64_t* wp = w.data_ptr<int64_t>();
  // ---- stage 1: touched pages (physical id, first row) and the highest slot written in each
  std::vector<std::array<int64_t, 3>> touched;  // (id, first row, slots)
  touched.reserve(T);
  for (int64_t i = 0; i < T; ++i) {
    const int64_t row = wp[i];
    TORCH_CHECK_VALUE(row >= 0 && row < N, "tinyserve.paged_write (native): argument 'write_rows' [", i, "] = ", row,
                      " is outside the buffer of ", N, " rows");
    const int64_t off = row % rows_per_block, slot = off % S;
    TORCH_CHECK_VALUE(off < pages_per_block * S, "tinyserve.paged_write (native): argument 'write_rows' [", i, "] = ",
                      row, " is not in a page of this layer");
    const int64_t id = (row / rows_per_block) * pages_per_block + off / S;
    TORCH_CHECK_VALUE(id < NP, "tinyserve.paged_write (native): argument 'write_rows' [", i, "] = ", row,
                      " is in page ", id, ", past the bounds (", NP, " pages)");
    touched.push_back({id, row - slot, slot + 1});
  }
  // ---- stage 2: the write itself (index_copy_ checks key/value against the buffer)
  at::Tensor kt = k_tokens, vt = v_tokens;
  kt.index_copy_(0, w, key);
  vt.index_copy_(0, w, value);
  std::sort(touched.begin(), touched.end());
  std::vector<int64_t> first, slots, pages;
  for (size_t i = 0; i < touched.size(); ++i) {
    if (i + 1 < touched.size() && touched[i + 1][0] == touched[i][0]) continue;  // the last of a page: most slots
    pages.push_back(touched[i][0]);
    first.push_back(touched[i][1]);
    slots.push_back(touched[i][2]);
  }
  // ---- stage 3: their bounds from the buffer
  const int64_t n = static_cast<int64_t>(pages.size());
  for (int64_t j = 0; j < n; ++j)
    TORCH_CHECK_VALUE(first[j] + slots[j] <= N, "tinyserve.paged_write (native): page ", pages[j],
                      " runs past the buffer");
  paged_bounds(k_tokens, kmax, kmin, kabs, first.data(), slots.data(), pages.data(), n, S);
  bool* fp = fresh.data_ptr<bool>();
  for (int64_t j = 0; j < n; ++j) fp[pages[j]] = true;
  at::Tensor out = at::empty({n}, write_rows.options().dtype(at::kLong).device(at::kCPU));
  std::copy(pages.begin(), pages.end(), out.data_ptr<int64_t>());
  return out;
}

void paged_bounds_rebuild(const at::Tensor& k_tokens, const at::Tensor& kmax, const at::Tensor& kmin,
                          const at::Tensor& kabs, const at::Tensor& first_rows, const at::Tensor& n_slots,
                          const at::Tensor& page_ids, int64_t page_size) {
  check_buffer(k_tokens, "k_tokens");
  const int64_t N = k_tokens.size(0), S = page_size;
  check_bounds(kmax, kmin, kabs, k_tokens.size(1), k_tokens.size(2));
  TORCH_CHECK_VALUE(S > 0, "tinyserve.paged_bounds_rebuild (native): argument 'page_size' must be positive");
  const at::Tensor f = long_cpu(first_rows, "first_rows").reshape({-1});
  const at::Tensor s = long_cpu(n_slots, "n_slots").reshape({-1});
  const at::Tensor ids = long_cpu(page_ids, "page_ids").reshape({-1});
  const int64_t n = f.numel();
  TORCH_CHECK_VALUE(s.numel() == n && ids.numel() == n, "tinyserve.paged_bounds_rebuild (native): arguments ",
                    "'first_rows', 'n_slots' and 'page_ids' must have one length");
  const int64_t *fp = f.data_ptr<int64_t>(), *sp = s.data_ptr<int64_t>(), *ip = ids.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) {
    TORCH_CHECK_VALUE(sp[j] >= 1 && sp[j] <= S, "tinyserve.paged_bounds_rebuild (native): argument 'n_slots' [", j,
                      "] = ", sp[j], " must be in [1, ", S, "]");
    TORCH_CHECK_VALUE(fp[j] >= 0 && fp[j] + sp[j] <= N, "tinyserve.paged_bounds_rebuild (native): argument ",
                      "'first_rows' [", j, "] = ", fp[j], " puts the page outside the buffer of ", N, " rows");
    TORCH_CHECK_VALUE(ip[j] >= 0 && ip[j] < kmax.size(0), "tinyserve.paged_bounds_rebuild (native): argument ",
                      "'page_ids' [", j, "] = ", ip[j], " is not a page of the bounds");
  }
  paged_bounds(k_tokens, kmax, kmin, kabs, fp, sp, ip, n, S);
}

void register_paged_cpu_kernel(pybind11::object python_kernel) {
  static std::unique_ptr<torch::Library> library;
  // boxed: reached with a generic list of SymInts for `spec` from Inductor's C++ wrapper (normalise_int_lists)
  if (new_cpu_library(library, fallback, std::move(python_kernel)))
    TINYSERVE_IMPL_INT_LIST_TOLERANT(*library, "paged_sparse_decode", TORCH_FN(paged_sparse_decode_cpu));
}

}  // namespace tinyserve_native
