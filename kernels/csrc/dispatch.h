// Registration of the native CPU kernel of tinyserve::sparse_decode with the dispatcher (dispatch.cpp).
// Part of the native CPU kernels of tinyserve-compile (overview: sparse_decode.cpp).
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace tinyserve_native {

// make the native kernel the CPU kernel of tinyserve::sparse_decode; python_kernel(same arguments) runs the
// choices of the `kernel` argument other than "auto" and "native"
void register_cpu_kernel(pybind11::object python_kernel);

}  // namespace tinyserve_native
