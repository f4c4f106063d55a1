// The int4 decode GEMV (gemv_int4.cpp): y = x @ W^T (+ b) with W in ATen's CPU int4pack layout (blocks of 64 or 32 rows).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace tinyserve_native {

// the most activation rows (product of x's leading dimensions) the int4 GEMV takes; more go to ATen's kernel
constexpr int64_t INT4_GEMV_MAX_ROWS = 8;

// the rows per block of the layout _convert_weight_to_int4pack_for_cpu packs in this process (64 on AVX-512 ATen, 32
// on AVX2 ATen), or 0 for a layout the GEMV does not read (ATen's scalar build); probed once
int64_t aten_int4_block_n();
// ATen's kernel for every int4 linear (true), or the GEMV where it applies (false, the default): the choice
// kernels/linear.py makes per machine at load (the faster of the two, timed), for the whole process
void set_int4_aten(bool aten);
bool int4_aten();
// whether linear_int4_rows runs the GEMV for these arguments (else it calls _weight_int4pack_mm_for_cpu)
bool int4_gemv_applies(const at::Tensor& x, const at::Tensor& qdata, const at::Tensor& sz, int64_t gs, int64_t N);
// x [..., K] bf16, qdata [N, K/2] uint8 (int4pack), scale_and_zero [K/gs, N, 2] bf16, bias [N] or none
// -> [..., N] in x's dtype
at::Tensor linear_int4_rows(const at::Tensor& x, const at::Tensor& qdata, const at::Tensor& scale_and_zero,
                            int64_t group_size, int64_t out_features, const std::optional<at::Tensor>& bias);

// several int4 weights (qdata[i] [N_i, K/2], scale_and_zero[i] [K/gs, N_i, 2]), no bias, that read one x ->
// [..., sum N_i] (the outputs side by side, in the weights' order), in one parallel region (ATen's kernel per weight
// where linear_int4_rows would call it)
at::Tensor linear_int4_group_rows(const at::Tensor& x, at::TensorList qdata, at::TensorList scale_and_zero,
                                  int64_t group_size, at::IntArrayRef out_features);

}  // namespace tinyserve_native
