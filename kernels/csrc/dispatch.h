// Registration of the native CPU kernels of tinyserve::sparse_decode and tinyserve::cache_write with the
// dispatcher (dispatch.cpp).
// Part of the native CPU kernels of tinyserve-compile (overview: sparse_decode.cpp).
#pragma once

#include <ATen/core/boxing/KernelFunction.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <memory>
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

// a CPU registration of the tinyserve ops in `library`, made once per process (false when `library` holds one
// already), with `python_kernel` kept in `python_slot` for as long as it lives
bool new_cpu_library(std::unique_ptr<torch::Library>& library, pybind11::object*& python_slot,
                     pybind11::object python_kernel);

// make the native kernel the CPU kernel of tinyserve::sparse_decode (resp. tinyserve::cache_write), once per process;
// python_kernel(same arguments) runs the choices of the `kernel` argument other than "auto" and "native", and a
// call with a malformed spec
void register_sparse_decode_cpu_kernel(pybind11::object python_kernel);
void register_cache_write_cpu_kernel(pybind11::object python_kernel);
// give the listed tinyserve ops (names without the namespace) a C++ AutogradCPU kernel that passes the call through
// (no Python per call; with inputs that require grad under grad mode the outputs get a grad_fn that raises)
void register_autograd_passthrough(const std::vector<std::string>& ops);

}  // namespace tinyserve_native
