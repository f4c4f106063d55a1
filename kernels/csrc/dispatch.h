// Registration of the native CPU kernels of tinyserve::sparse_decode and tinyserve::cache_write with the
// dispatcher (dispatch.cpp).
// Part of the native CPU kernels of tinyserve-compile (overview: sparse_decode.cpp).
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

namespace tinyserve_native {

// make the native kernels the CPU kernels of tinyserve::sparse_decode and tinyserve::cache_write;
// sparse_decode_kernel(same arguments) runs the choices of the `kernel` argument other than "auto" and "native",
// cache_write_kernel(same arguments) runs the write while set_native_cache_write(false) is in force
void register_cpu_kernel(pybind11::object sparse_decode_kernel, pybind11::object cache_write_kernel);
void set_native_cache_write(bool on);
// give the listed tinyserve ops (names without the namespace) a C++ AutogradCPU kernel that passes the call through
// (no Python per call; with inputs that require grad under grad mode the outputs get a grad_fn that raises)
void register_autograd_passthrough(const std::vector<std::string>& ops);

}  // namespace tinyserve_native
