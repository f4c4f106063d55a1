// The Python extension module of the native CPU kernels (see sparse_decode.cpp for the overview).
#include <torch/csrc/utils/pybind.h>

#include "bounds.h"
#include "dispatch.h"
#include "gemv.h"
#include "gemv_int4.h"
#include "paged.h"
#include "pipeline.h"
#include "pool.h"
#include "radix_select.h"
#include "spec.h"

namespace pybind11::detail {
// the `spec` argument of the functions below: SelectionSpec.to_list(), read by Spec::from_list
template <>
struct type_caster<tinyserve_native::Spec> {
  PYBIND11_TYPE_CASTER(tinyserve_native::Spec, _("list[int]"));
  bool load(handle src, bool convert) {
    make_caster<std::vector<int64_t>> list;
    if (!list.load(src, convert)) return false;
    value = tinyserve_native::Spec::from_list(cast_op<std::vector<int64_t>&>(list));
    return true;
  }
};
}  // namespace pybind11::detail

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sparse_decode", &tinyserve_native::sparse_decode, "query-aware paged sparse decode attention");
  m.def("kept_pages", &tinyserve_native::kept_pages, "the pages sparse_decode attends, bool [B, Hkv, P]");
  m.def("cache_write", &tinyserve_native::cache_write, "key write plus the bounds of the touched pages");
  m.def("rebuild_bounds", &tinyserve_native::rebuild_bounds, "every page's bounds");
  m.def("register_sparse_decode_cpu_kernel", &tinyserve_native::register_sparse_decode_cpu_kernel,
        "make the native kernel the CPU kernel of tinyserve::sparse_decode");
  m.def("register_cache_write_cpu_kernel", &tinyserve_native::register_cache_write_cpu_kernel,
        "make the native kernel the CPU kernel of tinyserve::cache_write");
  m.def("register_autograd_passthrough", &tinyserve_native::register_autograd_passthrough,
        "C++ AutogradCPU kernels for the listed tinyserve ops (replacing custom_op's Python ones on CPU)");
  m.def("scheduling", &tinyserve_native::scheduling_name,
        "which threads run the kernels' items: omp, pool, or auto and its current choice");
  m.def("set_scheduling", &tinyserve_native::set_scheduling,
        "force omp or pool, or auto, from now on (TINYSERVE_NATIVE_SCHED at load); returns the previous setting");
  m.def("paged_sparse_decode", &tinyserve_native::paged_sparse_decode, "sparse decode through page tables");
  m.def("paged_write", &tinyserve_native::paged_write, "paged key/value write plus the bounds of the touched pages");
  m.def("paged_bounds_rebuild", &tinyserve_native::paged_bounds_rebuild, "bounds of listed pages of a paged buffer");
  m.def("register_paged_cpu_kernel", &tinyserve_native::register_paged_cpu_kernel,
        "make the native kernel the CPU kernel of tinyserve::paged_sparse_decode");
  m.def(
      "select_top",
      [](const at::Tensor& w, int64_t n_keep, bool radix_only) {
        TORCH_CHECK(w.dim() == 1 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.device().is_cpu(),
                    "select_top: argument 'w' must be a contiguous 1-D float32 CPU tensor");
        TORCH_CHECK(n_keep >= 0, "select_top: argument 'n_keep' must be >= 0, got ", n_keep);
        const int64_t n = w.numel();
        std::vector<uint32_t> keys(2 * n + 1);
        at::Tensor out = at::empty({std::min(n, n_keep)}, w.options().dtype(at::kInt));
        const int64_t cnt = tinyserve_native::select_top(w.data_ptr<float>(), n, n_keep, keys.data(),
                                                         out.data_ptr<int32_t>(), radix_only);
        return out.narrow(0, 0, cnt).clone();
      },
      "indices of the n_keep largest of w, ascending, -inf left out, ties to the lowest indices (the op's selection; "
      "radix_only: its radix select path whatever the sizes)");
  m.def("linear_rows", &tinyserve_native::linear_rows, "x @ W^T (+ b) as a GEMV for at most 8 rows, else at::linear");
  m.def("aten_int4_block_n", &tinyserve_native::aten_int4_block_n,
        "rows per block of ATen's CPU int4pack layout in this process (64 or 32), 0 for one the int4 GEMV does not read");
  m.def("set_int4_aten", &tinyserve_native::set_int4_aten,
        "true: the int4 linears run ATen's _weight_int4pack_mm_for_cpu; false: the int4 GEMV where it applies");
  m.def("int4_aten", &tinyserve_native::int4_aten, "whether the int4 linears run ATen's kernel (set_int4_aten)");
  m.def("linear_int4_rows", &tinyserve_native::linear_int4_rows,
        "x @ W^T (+ b) for int4pack weights as a GEMV for at most 8 rows, else _weight_int4pack_mm_for_cpu");
  m.def("linear_group_rows",
        [](const at::Tensor& x, const std::vector<at::Tensor>& w) { return tinyserve_native::linear_group_rows(x, w); },
        "linear_rows of several weights (no bias) that read one x, side by side, in one parallel region");
  m.def("linear_int4_group_rows",
        [](const at::Tensor& x, const std::vector<at::Tensor>& q, const std::vector<at::Tensor>& sz, int64_t gs,
           const std::vector<int64_t>& n) { return tinyserve_native::linear_int4_group_rows(x, q, sz, gs, n); },
        "linear_int4_rows of several weights (no bias) that read one x, side by side, in one parallel region");
  m.def("register_linear_kernel", &tinyserve_native::register_linear_kernel,
        "make linear_rows, linear_int4_rows and their grouped forms the CPU kernels of tinyserve::linear, linear_int4, "
        "linear_group and linear_int4_group");
}
