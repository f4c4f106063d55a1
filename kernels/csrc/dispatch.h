// Registration of the native CPU kernels of tinyserve::sparse_decode and tinyserve::cache_write with the
// dispatcher (dispatch.cpp).
// Part of the native CPU kernels of tinyserve-compile (overview: sparse_decode.cpp).
#pragma once

#include <ATen/core/boxing/KernelFunction.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <string>
#include <vector>

namespace tinyserve_native {

// Rewrite each `int[]`/`SymInt[]` argument on the stack that arrives as a generic list (of ints or SymInts) into an
// int list. Inductor's C++ wrapper calls the ops through a boxed stack whose `SymInt[]` arguments (the `spec` of the
// ops torch.library.custom_op defines) are generic lists of SymInts, which the unboxed kernels'
// ArrayRef<int64_t> cannot take; Python and the dispatcher's own boxing give int lists,
// so the check is one tag compare per argument and nothing else.
void normalise_int_lists(const c10::OperatorHandle& op, torch::jit::Stack* stack);

// The boxed kernel registered for an unboxed kernel `Fn` (a TORCH_FN): normalises the int lists, then runs `Fn`.
template <class Fn>
void int_list_tolerant(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  static const c10::KernelFunction kernel = c10::KernelFunction::makeFromUnboxedFunction(Fn());
  normalise_int_lists(op, stack);
  kernel.callBoxed(op, ks, stack);
}

// register `fn` (a TORCH_FN) as `name`'s kernel in `library`, reached by every caller, boxed or not
#define TINYSERVE_IMPL_INT_LIST_TOLERANT(library, name, fn) \
  (library).impl((name), torch::CppFunction::makeFromBoxedFunction<&::tinyserve_native::int_list_tolerant<decltype(fn)>>())

// make the native kernels the CPU kernels of tinyserve::sparse_decode and tinyserve::cache_write;
// sparse_decode_kernel(same arguments) runs the choices of the `kernel` argument other than "auto" and "native",
// cache_write_kernel(same arguments) runs the write while set_native_cache_write(false) is in force
void register_cpu_kernel(pybind11::object sparse_decode_kernel, pybind11::object cache_write_kernel);
void set_native_cache_write(bool on);
// give the listed tinyserve ops (names without the namespace) a C++ AutogradCPU kernel that passes the call through
// (no Python per call; with inputs that require grad under grad mode the outputs get a grad_fn that raises)
void register_autograd_passthrough(const std::vector<std::string>& ops);

}  // namespace tinyserve_native
