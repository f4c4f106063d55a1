// The CPU kernels of tinyserve::sparse_decode and tinyserve::cache_write, registered with the dispatcher once the
// native module has loaded and passed its self-check, so that a compiled graph's calls reach C++ with no Python in
// between.
// Part of the native CPU kernels of tinyserve-compile (overview: sparse_decode.cpp).
#include <ATen/core/grad_mode.h>
#include <torch/autograd.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "bounds.h"
#include "dispatch.h"
#include "pipeline.h"
#include "spec.h"

namespace tinyserve_native {
namespace {

// the ops' Python kernels: sparse_decode's runs every other choice of the `kernel` argument ("torch", "triton");
// both run a call whose spec is malformed (SelectionSpec.from_list names what is wrong)
pybind11::object* fallback = nullptr;
pybind11::object* cache_write_fallback = nullptr;

at::Tensor sparse_decode_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& kmax, const at::Tensor& kmin, const at::Tensor& kabs,
                             const at::Tensor& valid_len, const std::optional<at::Tensor>& attn_mask, double scale,
                             c10::ArrayRef<int64_t> spec, c10::string_view kernel,
                             const std::optional<at::Tensor>& ctrl) {
  if ((kernel == "auto" || kernel == "native") && spec.size() == Spec::kFields) {
    return sparse_decode(q, k_cache, v_cache, kmax, kmin, kabs, valid_len, attn_mask, scale, Spec::from_list(spec),
                         ctrl);
  }
  pybind11::gil_scoped_acquire gil;
  pybind11::object out = (*fallback)(q, k_cache, v_cache, kmax, kmin, kabs, valid_len, attn_mask, scale,
                                     std::vector<int64_t>(spec.begin(), spec.end()), std::string(kernel), ctrl);
  return out.cast<at::Tensor>();
}

void cache_write_cpu(const at::Tensor& k_cache, const at::Tensor& kmax, const at::Tensor& kmin, const at::Tensor& kabs,
                     const at::Tensor& ctrl, const at::Tensor& positions, const at::Tensor& src,
                     c10::ArrayRef<int64_t> spec) {
  if (spec.size() == Spec::kFields) {
    TORCH_CHECK_VALUE(ctrl.device().is_cpu() && ctrl.scalar_type() == at::kInt &&
                          (ctrl.numel() == 2 || ctrl.numel() == kCtrlSize) && ctrl.is_contiguous(),
                      "cache_write: argument 'ctrl' must be a contiguous int32 CPU tensor of 2 or ", kCtrlSize,
                      " elements, got ",
                      ctrl.scalar_type(), " ", ctrl.sizes(), " on ", ctrl.device());
    // positions of any integer dtype and src of any float dtype, as the PyTorch path takes them
    const at::Tensor s = src.scalar_type() == k_cache.scalar_type() ? src : src.to(k_cache.scalar_type());
    cache_write(k_cache, kmax, kmin, kabs, ctrl, positions, s, Spec::from_list(spec).page_size);
    return;
  }
  pybind11::gil_scoped_acquire gil;
  (*cache_write_fallback)(k_cache, kmax, kmin, kabs, ctrl, positions, src,
                          std::vector<int64_t>(spec.begin(), spec.end()));
}

// The graph node of a call whose inputs require grad: forward runs the op below autograd, backward raises (the ops
// have no derivative). It is a torch::autograd::Function, the public C++ autograd API (torch/autograd.h, unchanged
// from torch 2.8 to 2.15), so the node is made and attached by torch's own header: torch 2.13 holds nodes in
// c10::intrusive_ptr where earlier releases hold them in std::shared_ptr, and the internal calls that take one
// (torch::autograd::set_history with a NotImplemented node) compile on one side of that change only.
struct NoDerivative : torch::autograd::Function<NoDerivative> {
  // `inputs`, the tensors that require grad, are not read here: Function::apply takes the node's edges from them
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                const c10::OperatorHandle* op, c10::DispatchKeySet ks,
                                                torch::jit::Stack* stack) {
    (void)inputs;
    ctx->saved_data["op"] = op->schema().name();
    op->redispatchBoxed(ks & c10::after_ADInplaceOrView_keyset, stack);
    torch::autograd::variable_list outputs;  // the tensor returns; integer ones get no grad_fn (Function's rule)
    const size_t n_out = op->schema().returns().size();
    for (size_t i = stack->size() - n_out; i < stack->size(); ++i) {
      if ((*stack)[i].isTensor()) outputs.push_back((*stack)[i].toTensor());
    }
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    (void)grad_outputs;
    TORCH_CHECK(false, "the derivative of ", ctx->saved_data["op"].toStringRef(),
                " is not implemented: backward cannot pass through this op");
    return {};
  }
};

// The AutogradCPU kernel of the ops registered here (boxed, one for all). It replaces torch.library.custom_op's
// Python autograd and ADInplaceOrView kernels on CPU, which cost about 30 us per call, and does what they did:
// bumps the version counters of the arguments the schema says it writes, hands the call to the keys below
// ADInplaceOrView (CPU for real tensors, Python for fake ones under torch.compile's tracing), and when an input
// requires grad under grad mode gives the outputs a grad_fn that raises on backward (NoDerivative).
void autograd_passthrough(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t n = args.size();
  const size_t first = stack->size() - n;
  const bool grad = at::GradMode::is_enabled();
  std::vector<at::Tensor> inputs;  // those that require grad under grad mode
  for (size_t i = 0; i < n; ++i) {
    const c10::IValue& v = (*stack)[first + i];
    if (!v.isTensor()) continue;
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) continue;
    if (grad && t.requires_grad()) inputs.push_back(t);
    // TensorImpl::bump_version: c10's own call, what torch::autograd::impl::bump_version wraps
    if (args[i].alias_info() != nullptr && args[i].alias_info()->isWrite()) t.unsafeGetTensorImpl()->bump_version();
  }
  if (inputs.empty()) {
    op.redispatchBoxed(ks & c10::after_ADInplaceOrView_keyset, stack);
    return;
  }
  const torch::autograd::variable_list outputs = NoDerivative::apply(at::TensorList(inputs), &op, ks, stack);
  // the same tensors with their grad_fn set, back in their places among the returns
  size_t next = 0;
  const size_t n_out = op.schema().returns().size();
  for (size_t i = stack->size() - n_out; i < stack->size(); ++i) {
    if ((*stack)[i].isTensor()) (*stack)[i] = outputs[next++];
  }
}

}  // namespace

void normalise_int_lists(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t n = args.size();
  const size_t first = stack->size() - n;
  for (size_t i = 0; i < n; ++i) {
    c10::IValue& v = (*stack)[first + i];
    if (!v.isList()) continue;  // int lists, tensors, scalars: as the kernel takes them
    // `int[]` and `SymInt[]` (torch.library.custom_op writes `SymInt[]` for a list[int] hint)
    const c10::TypePtr& t = args[i].real_type();
    if (t->kind() != c10::TypeKind::ListType) continue;
    const c10::TypeKind elem = t->castRaw<c10::ListType>()->getElementType()->kind();
    if (elem != c10::TypeKind::IntType && elem != c10::TypeKind::SymIntType) continue;
    const auto items = v.toListRef();
    c10::List<int64_t> ints;
    ints.reserve(items.size());
    for (const c10::IValue& e : items) {
      TORCH_CHECK_VALUE(e.isInt() || e.isSymInt(), op.schema().name(), ": argument '", args[i].name(),
                        "' must be a list of ints, got an element of type ", e.tagKind());
      ints.push_back(e.isInt() ? e.toInt() : e.toSymInt().guard_int(__FILE__, __LINE__));
    }
    v = c10::IValue(std::move(ints));
  }
}

void register_autograd_passthrough(const std::vector<std::string>& ops) {
  static std::unique_ptr<torch::Library> library;
  static std::vector<std::string> done;
  if (!library) {
    library = std::make_unique<torch::Library>(torch::Library::IMPL, "tinyserve", c10::DispatchKey::AutogradCPU,
                                               __FILE__, __LINE__);
  }
  for (const auto& name : ops) {
    if (std::find(done.begin(), done.end(), name) != done.end()) continue;
    library->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&autograd_passthrough>());
    done.push_back(name);
  }
}

bool new_cpu_library(std::unique_ptr<torch::Library>& library, pybind11::object*& python_slot,
                     pybind11::object python_kernel) {
  if (library) return false;  // once per process
  python_slot = new pybind11::object(std::move(python_kernel));  // lives as long as the registration
  library = std::make_unique<torch::Library>(torch::Library::IMPL, "tinyserve", c10::DispatchKey::CPU, __FILE__,
                                             __LINE__);
  return true;
}

// boxed: reached with generic lists of SymInts for `spec` from Inductor's C++ wrapper (normalise_int_lists)
void register_sparse_decode_cpu_kernel(pybind11::object python_kernel) {
  static std::unique_ptr<torch::Library> library;
  if (new_cpu_library(library, fallback, std::move(python_kernel)))
    TINYSERVE_IMPL_INT_LIST_TOLERANT(*library, "sparse_decode", TORCH_FN(sparse_decode_cpu));
}

void register_cache_write_cpu_kernel(pybind11::object python_kernel) {
  static std::unique_ptr<torch::Library> library;
  if (new_cpu_library(library, cache_write_fallback, std::move(python_kernel)))
    TINYSERVE_IMPL_INT_LIST_TOLERANT(*library, "cache_write", TORCH_FN(cache_write_cpu));
}

}  // namespace tinyserve_native
