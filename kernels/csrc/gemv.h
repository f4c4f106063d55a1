// The decode GEMV (gemv.cpp): y = x @ W^T (+ b) for at most GEMV_MAX_ROWS activation rows.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace tinyserve_native {

// the most activation rows (product of x's leading dimensions) the GEMV takes; more go to ATen's linear
constexpr int64_t GEMV_MAX_ROWS = 8;
// the most rows for bf16 weights: each bf16 vector is widened to fp32 and meets every row with one FMA, so at
// more rows the loop is bound by FMAs per weight byte (twice fp32's), where oneDNN's AVX512-BF16 dot products
// (ATen's linear) do half the instructions
constexpr int64_t GEMV_MAX_ROWS_BF16 = 4;

// whether linear_rows runs the GEMV for these arguments (else it calls at::linear)
bool gemv_applies(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
// x [..., K] fp32 or bf16, weight [N, K] of x's dtype, bias [N] or none -> [..., N] in x's dtype
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
// several weights [N_i, K] of x's dtype, no bias, that read one x -> [..., sum N_i] (the outputs side by side, in
// the weights' order), in one parallel region (one ATen linear per weight where linear_rows would call at::linear)
at::Tensor linear_group_rows(const at::Tensor& x, at::TensorList weights);
// The result of several weights' outputs side by side, y [M, sum N_i] of `opt`, and where each weight's kernel
// writes its rows of N_i (ptrs[i]): y's own columns for one activation row (the row stride does not matter),
// else a buffer per weight (bufs) that the caller puts into y after, at::cat_out(y, bufs, 1)
template <typename T>
at::Tensor side_by_side(int64_t M, at::IntArrayRef N, const at::TensorOptions& opt, std::vector<at::Tensor>& bufs,
                        std::vector<T*>& ptrs) {
  int64_t total = 0;
  for (const int64_t n : N) total += n;
  at::Tensor y = at::empty({M, total}, opt);
  int64_t col = 0;
  for (const int64_t n : N) {
    if (M > 1) bufs.push_back(at::empty({M, n}, opt));
    ptrs.push_back(M > 1 ? bufs.back().data_ptr<T>() : y.data_ptr<T>() + col);
    col += n;
  }
  return y;
}
// x's shape with the last dimension n: the shape of a linear's result
inline std::vector<int64_t> out_shape(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return shape;
}
// make linear_rows the CPU kernel of tinyserve::linear (once per process)
void register_linear_kernel();

}  // namespace tinyserve_native
