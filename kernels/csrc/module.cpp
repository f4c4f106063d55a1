// The Python extension module of the native CPU kernels (see sparse_decode.cpp for the overview).
#include <torch/csrc/utils/pybind.h>

#include "bounds.h"
#include "dispatch.h"
#include "gemv.h"
#include "pipeline.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sparse_decode", &tinyserve_native::sparse_decode, "query-aware paged sparse decode attention");
  m.def("kept_pages", &tinyserve_native::kept_pages, "the pages sparse_decode attends, bool [B, Hkv, P]");
  m.def("cache_write", &tinyserve_native::cache_write, "key write plus the bounds of the touched pages");
  m.def("rebuild_bounds", &tinyserve_native::rebuild_bounds, "every page's bounds");
  m.def("register_cpu_kernel", &tinyserve_native::register_cpu_kernel,
        "make the native kernel the CPU kernel of tinyserve::sparse_decode");
  m.def("linear_rows", &tinyserve_native::linear_rows, "x @ W^T (+ b) as a GEMV for at most 8 rows, else at::linear");
  m.def("register_linear_kernel", &tinyserve_native::register_linear_kernel,
        "make linear_rows the CPU kernel of tinyserve::linear");
}
