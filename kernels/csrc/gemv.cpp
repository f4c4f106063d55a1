// A GEMV for decode-shaped linears: y[M, N] = x[M, K] @ W[N, K]^T (+ b) for M <= 8 rows, fp32 or bf16 weights,
// fp32 accumulation. It is the CPU kernel of tinyserve::linear once registered (register_linear_kernel).
// Part of the native CPU kernels of tinyserve-compile (overview: sparse_decode.cpp).
//
// Why: at one or a few activation rows a linear is a stream over its weight, and the time is bytes over
// bandwidth. The nn.Linear weight is [N, K] row-major, so each output element is a dot product over one
// contiguous weight row. The N rows are split into one contiguous range per thread, so each thread streams its
// share of the weight once, front to back, with all M activation rows applied to each loaded vector of weights.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <type_traits>

#include "gemv.h"
#include "gemv_int4.h"
#include "simd.h"

namespace tinyserve_native {
namespace {

using FVec = at::vec::Vectorized<float>;
constexpr int64_t FVS = FVec::size();
// the least weight bytes per task of parallel_for: a smaller weight runs on the calling thread alone (a parallel
// region costs microseconds, and on a busy machine a descheduled worker stalls the call for a time slice)
constexpr int64_t MIN_TASK_BYTES = 64 * 1024;
// software prefetch distance of the weight stream, prefetched into L2 at every row count (side by side, weights read
// from memory: 1.09-1.45x at 8 rows, 1.0-1.5x at 4, 0.96-1.14x at 1 fp32 row; into L1, at 5-8 rows only, as before,
// 1 row had been slower)
constexpr int64_t PREFETCH_BYTES = 4096;


// Output rows [n0, n1) of y (the weight's dtype, M rows ldy apart) in groups of R weight rows: each weight vector is
// loaded once and meets all M activation rows (M * R accumulators live in registers). A > 1 splits K over A accumulators per
// (weight row, activation row), A vectors apart: more independent FMA chains while the weight is read as one
// sequential stream (R = 1).
template <typename W, int M, int R, int A = 1>
void gemv_rows(const float* x, const W* w, const float* bias, W* y, int64_t K, int64_t ldy, int64_t n0,
               int64_t n1) {
  const int64_t kv = K - K % FVS;  // vectorised part of K; the rest is a scalar tail
  const int64_t ka = K - K % (A * FVS);  // the part of it in whole steps of A vectors
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    // ---- stage 1: fp32 partial sums, A vectors per (weight row, activation row), folded into acc[0]
    FVec acc[A][R][M];
    for (int a = 0; a < A; ++a)
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m) acc[a][r][m] = FVec(0.f);
    for (int64_t k = 0; k < ka; k += A * FVS) {
      // ---- software prefetch of the weight PREFETCH_BYTES ahead into L2, one per 64 bytes of this step (at least
      // one a step, so a 32-byte bf16 step prefetches each line twice): with several FMAs per weight vector the loop
      // reads too slowly for the hardware prefetcher to hide the memory latency, and into L2 (not L1) more lines can
      // be in flight
      for (int r = 0; r < R; ++r)
        for (int64_t off = 0; off < A * FVS * int64_t(sizeof(W)); off += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(w + (n + r) * K + k) + off + PREFETCH_BYTES, 0, 2);
      for (int a = 0; a < A; ++a) {
        FVec xv[M];
        for (int m = 0; m < M; ++m) xv[m] = FVec::loadu(x + m * K + k + a * FVS);
        for (int r = 0; r < R; ++r) {
          const FVec wv = loadf(w + (n + r) * K + k + a * FVS);
          for (int m = 0; m < M; ++m) acc[a][r][m] = at::vec::fmadd(wv, xv[m], acc[a][r][m]);
        }
      }
    }
    for (int64_t k = ka; k < kv; k += FVS) {  // the vectors of K past the last whole step of A (into acc[0])
      FVec xv[M];
      for (int m = 0; m < M; ++m) xv[m] = FVec::loadu(x + m * K + k);
      for (int r = 0; r < R; ++r) {
        const FVec wv = loadf(w + (n + r) * K + k);
        for (int m = 0; m < M; ++m) acc[0][r][m] = at::vec::fmadd(wv, xv[m], acc[0][r][m]);
      }
    }
    for (int a = 1; a < A; ++a)
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m) acc[0][r][m] = acc[0][r][m] + acc[a][r][m];
    // ---- stage 2: lane sums, the scalar tail of K, the bias
    alignas(64) float sums[R * M > FVS ? R * M : FVS];  // sums[r * M + m]: lanes of acc[r][m] added
    bool summed = false;
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (R * M <= FVS && R * M >= 4) {
      // all R * M lane sums in one transpose-and-add (reduce_rows), not one horizontal sum each (below 4 sums the
      // horizontal sums cost less than the 16-vector transpose)
      FVec red[FVS];
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m) red[r * M + m] = acc[0][r][m];
      for (int i = R * M; i < FVS; ++i) red[i] = FVec(0.f);
      reduce_rows(red).store(sums);
      summed = true;
    }
#endif
    if (!summed) {
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m)
          sums[r * M + m] = at::vec::vec_reduce_all<float>([](FVec& a, FVec& b) { return a + b; }, acc[0][r][m]);
    }
    for (int r = 0; r < R; ++r) {
      for (int m = 0; m < M; ++m) {
        float s = sums[r * M + m];
        for (int64_t k = kv; k < K; ++k) s += static_cast<float>(w[(n + r) * K + k]) * x[m * K + k];
        y[m * ldy + n + r] = static_cast<W>(s + (bias ? bias[n + r] : 0.f));  // fp32 sum, rounded once
      }
    }
  }
  if (n < n1) gemv_rows<W, M, 1, A>(x, w, bias, y, K, ldy, n, n1);  // leftover rows, one at a time
}

// One weight row at a time: each thread reads its weight rows as one sequential stream. Groups of 4 rows (at 1-2
// activation rows) and 2 (at 3-4), interleaved streams one weight row apart, were slower on weights read from
// memory, as in a decode step (SmolLM2's shapes, 2 threads, both builds side by side in one process, two runs):
// one row at a time was 1.08-1.48x faster at 1 fp32 row (one 0.91x), 1.29-1.99x at 1 bf16 row, 1.0-1.9x at 2-4
// rows, except K = 1536 at 2-4 bf16 rows (0.78-0.99x). The FMA chains the groups gave come from A accumulators
// along K per (weight row, activation row): 4 independent chains at 1 and 2 activation rows.
template <int M>
constexpr int k_accumulators() {
  return M == 1 ? 4 : (M == 2 ? 2 : 1);
}

template <typename W, int M, int R>
void gemv_split(const float* x, const W* w, const float* bias, W* y, int64_t K, int64_t N) {
  // one contiguous range of weight rows per thread, each at least MIN_TASK_BYTES of weights
  const int64_t grain = std::max<int64_t>(R, MIN_TASK_BYTES / std::max<int64_t>(1, K * int64_t(sizeof(W))));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    gemv_rows<W, M, R, k_accumulators<M>()>(x, w, bias, y, K, N, n0, n1);
  });
}

// 5-8 activation rows over a weight streamed from memory (an output head) or rows of x too long for L1 (K over
// 1024): 2 weight rows per group (16 accumulators + 8 rows of x + 1 of 32 registers) halve the loads of x per
// FMA. Measured at 8 rows, 2 threads: 49152x576 1.5x and 576x1536 1.25x faster; cache-resident 576- and
// 1536-row weights with K = 576 ran slower that way, so they keep one row per group.
template <typename W, int M>
constexpr bool two_weight_rows(int64_t K, int64_t N) {
#if defined(CPU_CAPABILITY_AVX512)
  return M > 4 && (K > 1024 || N * K * int64_t(sizeof(W)) > (int64_t(16) << 20));
#else
  return false;
#endif
}

template <typename W, int M>
void gemv_m(const float* x, const W* w, const float* bias, W* y, int64_t K, int64_t N) {
  if constexpr (M > 4) {
    if (two_weight_rows<W, M>(K, N)) return gemv_split<W, M, 2>(x, w, bias, y, K, N);
  }
  gemv_split<W, M, 1>(x, w, bias, y, K, N);
}

// f(std::integral_constant<int, M>) for M = 1..8 activation rows (more rows never reach the GEMV)
template <typename F>
void with_rows(int64_t M, const F& f) {
  switch (M) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

template <typename W>
void gemv(const float* x, const W* w, const float* bias, W* y, int64_t M, int64_t K, int64_t N) {
  with_rows(M, [&](auto m) { gemv_m<W, decltype(m)::value>(x, w, bias, y, K, N); });
}

// ---- several weights [N_i, K] that read one x: one parallel region over all their rows, so that a layer's q, k
// and v (or gate and up) projections cost one call and one fork/join instead of one each; weight i writes columns
// [start[i], start[i + 1]) of y [M, ldy]
template <typename W, int M>
void gemv_group_m(const float* x, const std::vector<const W*>& w, const std::vector<int64_t>& N, W* y, int64_t ldy,
                  int64_t K) {
  constexpr int R = 1;
  std::vector<int64_t> start(N.size() + 1, 0);  // weight i holds rows [start[i], start[i + 1]) of the union
  for (size_t i = 0; i < N.size(); ++i) start[i + 1] = start[i] + N[i];
  const int64_t grain = std::max<int64_t>(2 * R, MIN_TASK_BYTES / std::max<int64_t>(1, K * int64_t(sizeof(W))));
  at::parallel_for(0, start.back(), grain, [&](int64_t a, int64_t b) {
    for (size_t i = 0; i < N.size(); ++i) {
      const int64_t lo = std::max(a, start[i]) - start[i], hi = std::min(b, start[i + 1]) - start[i];
      if (lo >= hi) continue;
      if constexpr (M > 4) {  // the weight rows per group gemv_m takes for this weight alone
        if (two_weight_rows<W, M>(K, N[i])) {
          gemv_rows<W, M, 2>(x, w[i], nullptr, y + start[i], K, ldy, lo, hi);
          continue;
        }
      }
      gemv_rows<W, M, R, k_accumulators<M>()>(x, w[i], nullptr, y + start[i], K, ldy, lo, hi);
    }
  });
}

template <typename W>
void gemv_group(const float* x, const std::vector<const W*>& w, const std::vector<int64_t>& N, W* y, int64_t ldy,
                int64_t M, int64_t K) {
  with_rows(M, [&](auto m) { gemv_group_m<W, decltype(m)::value>(x, w, N, y, ldy, K); });
}

std::unique_ptr<torch::Library> linear_library;

at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return linear_rows(x, weight, bias);
}

at::Tensor linear_int4_cpu(const at::Tensor& x, const at::Tensor& qdata, const at::Tensor& scale_and_zero,
                           int64_t group_size, int64_t out_features, const std::optional<at::Tensor>& bias) {
  return linear_int4_rows(x, qdata, scale_and_zero, group_size, out_features, bias);
}

at::Tensor linear_group_cpu(const at::Tensor& x, at::TensorList weights) { return linear_group_rows(x, weights); }

at::Tensor linear_int4_group_cpu(const at::Tensor& x, at::TensorList qdata, at::TensorList scale_and_zero,
                                 int64_t group_size, at::IntArrayRef out_features) {
  return linear_int4_group_rows(x, qdata, scale_and_zero, group_size, out_features);
}

}  // namespace

bool gemv_applies(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  if (!x.device().is_cpu() || !weight.device().is_cpu() || weight.dim() != 2 || x.dim() < 1) return false;
  const auto wt = weight.scalar_type();
  if (!(wt == at::kFloat || wt == at::kBFloat16) || x.scalar_type() != wt) return false;
  const int64_t K = weight.size(1), N = weight.size(0);
  if (K == 0 || N == 0 || x.size(-1) != K || !weight.is_contiguous()) return false;
  const int64_t M = x.numel() / K;
  if (M < 1 || M > (wt == at::kBFloat16 ? GEMV_MAX_ROWS_BF16 : GEMV_MAX_ROWS)) return false;
  if (bias.has_value() && bias->defined()) {
    const auto& b = *bias;
    if (!b.device().is_cpu() || b.dim() != 1 || b.size(0) != N || b.scalar_type() != wt) return false;
  }
  return true;
}

namespace {

// x's M rows of K as fp32, without a tensor op on the way (a .to() or .contiguous() costs 2-4 us of dispatch, and a
// decode step makes ~120 of these calls): x's own data when it is fp32 and contiguous, else widened into a
// thread-local buffer (bf16 activations are a few KB); `keep` holds a contiguous copy of a strided x
const float* rows_f32(const at::Tensor& x, int64_t M, int64_t K, at::Tensor& keep) {
  const at::Tensor& xc = x.is_contiguous() ? x : (keep = x.contiguous());
  if (xc.scalar_type() == at::kFloat) return xc.data_ptr<float>();
  const c10::BFloat16* src = xc.data_ptr<c10::BFloat16>();
  float* dst = scratch_f<22>(M * K);  // read by the parallel region's threads, which the call outlives
  const int64_t n = M * K, nv = n - n % FVS;
  for (int64_t i = 0; i < nv; i += FVS) loadf(src + i).store(dst + i);
  for (int64_t i = nv; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  return dst;
}

}  // namespace

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  if (!gemv_applies(x, weight, bias)) return at::linear(x, weight, bias);  // any other shape: ATen's linear
  const int64_t K = weight.size(1), N = weight.size(0), M = x.numel() / K;
  at::Tensor keep;
  const float* xf = rows_f32(x, M, K, keep);  // [M, K] fp32
  at::Tensor bf;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    bf = bias->scalar_type() == at::kFloat ? bias->contiguous() : bias->to(at::kFloat).contiguous();
    bp = bf.data_ptr<float>();
  }
  at::Tensor y = at::empty(out_shape(x, N), x.options());  // [..., N] in x's dtype, written by the kernel
  if (weight.scalar_type() == at::kFloat) {
    gemv<float>(xf, weight.data_ptr<float>(), bp, y.data_ptr<float>(), M, K, N);
  } else {
    gemv<c10::BFloat16>(xf, weight.data_ptr<c10::BFloat16>(), bp, y.data_ptr<c10::BFloat16>(), M, K, N);
  }
  return y;
}

at::Tensor linear_group_rows(const at::Tensor& x, at::TensorList weights) {
  TORCH_CHECK(!weights.empty(), "linear_group: weights must not be empty");
  bool gemv_ok = true;
  for (const auto& w : weights)
    gemv_ok = gemv_ok && gemv_applies(x, w, std::nullopt) && w.scalar_type() == weights[0].scalar_type();
  if (!gemv_ok) {  // any other case: one ATen linear per weight
    std::vector<at::Tensor> out;
    for (const auto& w : weights) out.push_back(at::linear(x, w));
    return at::cat(out, -1);
  }
  const int64_t K = x.size(-1), M = x.numel() / K;
  at::Tensor keep;
  const float* xf = rows_f32(x, M, K, keep);  // [M, K] fp32, widened once for the group
  std::vector<int64_t> N;
  int64_t total = 0;
  for (const auto& w : weights) {
    N.push_back(w.size(0));
    total += w.size(0);
  }
  at::Tensor y = at::empty(out_shape(x, total), x.options());  // [..., sum N_i] in x's dtype, weight i's columns
  if (weights[0].scalar_type() == at::kFloat) {
    std::vector<const float*> wp;
    for (const auto& w : weights) wp.push_back(w.data_ptr<float>());
    gemv_group<float>(xf, wp, N, y.data_ptr<float>(), total, M, K);
  } else {
    std::vector<const c10::BFloat16*> wp;
    for (const auto& w : weights) wp.push_back(w.data_ptr<c10::BFloat16>());
    gemv_group<c10::BFloat16>(xf, wp, N, y.data_ptr<c10::BFloat16>(), total, M, K);
  }
  return y;
}

void register_linear_kernel() {
  if (linear_library) return;  // once per process
  linear_library = std::make_unique<torch::Library>(torch::Library::IMPL, "tinyserve", c10::DispatchKey::CPU,
                                                    __FILE__, __LINE__);
  linear_library->impl("linear", TORCH_FN(linear_cpu));
  linear_library->impl("linear_int4", TORCH_FN(linear_int4_cpu));
  linear_library->impl("linear_group", TORCH_FN(linear_group_cpu));
  linear_library->impl("linear_int4_group", TORCH_FN(linear_int4_group_cpu));
}

}  // namespace tinyserve_native
