// The CPU kernel of tinyserve::sparse_decode, registered with the dispatcher once the native module has loaded
// and passed its self-check, so that a compiled graph's call reaches C++ with no Python in between.
// Part of the native CPU kernels of tinyserve-compile (overview: sparse_decode.cpp).
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <memory>
#include <string>

#include "dispatch.h"
#include "pipeline.h"

namespace tinyserve_native {
namespace {

// the op's Python kernel: runs every other choice of the `kernel` argument ("torch", "triton")
pybind11::object* fallback = nullptr;
std::unique_ptr<torch::Library> cpu_library;

at::Tensor sparse_decode_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& kmax, const at::Tensor& kmin, const at::Tensor& kabs,
                             const at::Tensor& valid_len, const std::optional<at::Tensor>& attn_mask, double scale,
                             c10::ArrayRef<int64_t> spec, c10::string_view kernel,
                             const std::optional<at::Tensor>& ctrl) {
  // spec: page_size, token_budget, sink_pages, candidate_factor, candidate_extra, keep_tokens, bounds code
  if ((kernel == "auto" || kernel == "native") && spec.size() == 7) {
    return sparse_decode(q, k_cache, v_cache, kmax, kmin, kabs, valid_len, attn_mask, scale, spec[0], spec[1],
                         spec[2], spec[3], ctrl, spec[4], spec[5] != 0);
  }
  pybind11::gil_scoped_acquire gil;
  pybind11::object out = (*fallback)(q, k_cache, v_cache, kmax, kmin, kabs, valid_len, attn_mask, scale,
                                     std::vector<int64_t>(spec.begin(), spec.end()), std::string(kernel), ctrl);
  return out.cast<at::Tensor>();
}

}  // namespace

void register_cpu_kernel(pybind11::object python_kernel) {
  if (cpu_library) return;  // once per process
  fallback = new pybind11::object(std::move(python_kernel));  // lives as long as the registration
  cpu_library = std::make_unique<torch::Library>(torch::Library::IMPL, "tinyserve", c10::DispatchKey::CPU,
                                                 __FILE__, __LINE__);
  cpu_library->impl("sparse_decode", TORCH_FN(sparse_decode_cpu));
}

}  // namespace tinyserve_native
