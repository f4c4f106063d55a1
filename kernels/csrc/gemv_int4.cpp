// A GEMV for decode-shaped linears with int4 weights in ATen's CPU int4pack layout (torchao's Int4OpaqueTensor):
// y[M, N] = x[M, K] @ W[N, K]^T (+ b) for M <= 8 bf16 rows, fp32 accumulation, bf16 output. It is the CPU kernel of
// tinyserve::linear_int4 once registered (register_linear_kernel in gemv.cpp).
// Part of the native CPU kernels of tinyserve-compile (overview: sparse_decode.cpp).
//
// The weight is read in the layout _convert_weight_to_int4pack_for_cpu packs on this machine, which depends on
// ATen's CPU capability (aten_int4_block_n probes it once; kernels/linear.py checks the GEMV against a packed
// probe at load time): qdata [N/BN, K, BN/2] uint8, byte j of (block b, column k) holding row b*BN+j in its low
// nibble and row b*BN+BN/2+j in its high nibble, with BN = 64 on AVX-512 ATen and 32 on AVX2 ATen.
// scale_and_zero is [K/gs, N, 2] bf16, and the weight is W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]
// with g = k / gs.
//
// Why this layout streams well: a block of BN output rows reads BN/2 contiguous bytes per input column, so each
// thread streams its blocks front to back once. Within a group of gs columns the codes meet x as
// sum_k q[n, k] * x[k] (fp32 FMAs on the widened codes, x broadcast), and the group's scale and zero enter once:
// y[n] += scale * sum_k q x + (zero - 8 scale) * sum_k x.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "gemv.h"
#include "gemv_int4.h"
#include "simd.h"

namespace tinyserve_native {
namespace {

// the least weight bytes per task of parallel_for (see gemv.cpp)
constexpr int64_t MIN_TASK_BYTES = 64 * 1024;

// the BN sums of each activation row plus the bias, rounded once to bf16, into y (bf16 [M, N]) at rows n0..n0+BN-1
template <int M, int BN>
inline void store_rows(const float (&acc)[M][BN], const c10::BFloat16* bias, c10::BFloat16* y, int64_t N,
                       int64_t n0) {
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < BN; ++r)
      y[m * N + n0 + r] = c10::BFloat16(acc[m][r] + (bias ? static_cast<float>(bias[n0 + r]) : 0.f));
}

// activation rows [m0, m0 + Mc) of every block in [b0, b1), at most MaxM rows at once so that the sums stay in
// registers: block(std::integral_constant<int, Mc>, x rows, their group sums, y rows, block index)
template <int MaxM, typename T, typename Block>
void by_row_groups(const T* x, const float* xsum, c10::BFloat16* y, int64_t M, int64_t K, int64_t N, int64_t G,
                   int64_t b0, int64_t b1, const Block& block) {
  static_assert(MaxM >= 1 && MaxM <= 4, "row groups of 1 to 4 rows");
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t m0 = 0; m0 < M; m0 += MaxM) {
      const T* xm = x + m0 * K;
      const float* sm = xsum + m0 * G;
      c10::BFloat16* ym = y + m0 * N;
      switch (std::min<int64_t>(MaxM, M - m0)) {
        case 1: block(std::integral_constant<int, 1>{}, xm, sm, ym, b); break;
        case 2: if constexpr (MaxM >= 2) block(std::integral_constant<int, 2>{}, xm, sm, ym, b); break;
        case 3: if constexpr (MaxM >= 3) block(std::integral_constant<int, 3>{}, xm, sm, ym, b); break;
        default: if constexpr (MaxM >= 4) block(std::integral_constant<int, 4>{}, xm, sm, ym, b); break;
      }
    }
  }
}

// VS bytes at p as two fp32 vectors: their low nibbles (lo) and their high nibbles (hi), exact
inline void load_nibbles(const uint8_t* p, Vec& lo, Vec& hi) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
#else
  alignas(64) float l[VS], h[VS];
  for (int i = 0; i < VS; ++i) l[i] = float(p[i] & 15), h[i] = float(p[i] >> 4);
  lo = Vec::loadu(l), hi = Vec::loadu(h);
#endif
}

// the VS (scale, zero) bf16 pairs at p as two fp32 vectors (scale in the low half of each pair)
inline void load_scale_zero(const c10::BFloat16* p, Vec& s, Vec& z) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i v = _mm512_loadu_si512(p);
  s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  z = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xffff0000u))));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  s = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  z = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xffff0000u))));
#else
  alignas(64) float sv[VS], zv[VS];
  for (int i = 0; i < VS; ++i) sv[i] = static_cast<float>(p[2 * i]), zv[i] = static_cast<float>(p[2 * i + 1]);
  s = Vec::loadu(sv), z = Vec::loadu(zv);
#endif
}

// acc[m][r] += scale_r * aq[m][r] + (zero_r - offset * scale_r) * xsum[m, g] for the BN rows n0.. of group g, with
// aq the group's dot products of codes read as (q + offset), NV = BN / VS vectors per activation row
template <int M, int BN, int NV>
inline void apply_group(float (&acc)[M][BN], const Vec (&aq)[M][NV], const c10::BFloat16* sz, const float* xsum,
                        int64_t g, int64_t G, int64_t N, int64_t n0, float offset) {
  for (int i = 0; i < NV; ++i) {
    Vec s, z;
    load_scale_zero(sz + (g * N + n0 + VS * i) * 2, s, z);
    const Vec c = z - Vec(offset) * s;
    for (int m = 0; m < M; ++m) {
      Vec a = Vec::loadu(acc[m] + VS * i);
      a = at::vec::fmadd(s, aq[m][i], a);
      a = at::vec::fmadd(c, Vec(xsum[m * G + g]), a);
      a.store(acc[m] + VS * i);
    }
  }
}

// One block of BN output rows for activation rows [0, M) of x (bf16 widened to fp32 [M, K]) on every vector ISA
// (the bf16 dot-product block below is the AVX512-BF16 form for BN = 64); xsum [M, G] holds each group's sum of
// x; y (bf16 [M, N]) receives rows b*BN .. b*BN+BN-1 plus the bias (bf16 [N] or null).
template <int M, int BN>
void int4_block(const float* x, const float* xsum, const uint8_t* q, const c10::BFloat16* sz,
                const c10::BFloat16* bias, c10::BFloat16* y, int64_t K, int64_t N, int64_t gs, int64_t b) {
  constexpr int NV = BN / VS, HALF = NV / 2;  // vectors per row group; the low nibbles fill the first half
  static_assert(BN % (2 * VS) == 0, "a block holds whole vectors of low and of high nibbles");
  const int64_t G = K / gs, n0 = b * BN;
  const uint8_t* qb = q + b * K * (BN / 2);  // [K, BN/2] bytes of this block
  float acc[M][BN];
  std::memset(acc, 0, sizeof(acc));
  for (int64_t g = 0; g < G; ++g) {
    // ---- stage 1: sum_k q[n, k] * x[m, k] over the group, BN rows as NV vectors per activation row
    Vec aq[M][NV];
    for (int m = 0; m < M; ++m)
      for (int i = 0; i < NV; ++i) aq[m][i] = Vec(0.f);
    for (int64_t k = g * gs; k < (g + 1) * gs; ++k) {
      Vec w[NV];  // vector i: rows VS i .. VS i + VS - 1 of the block
      for (int c = 0; c < HALF; ++c) load_nibbles(qb + k * (BN / 2) + VS * c, w[c], w[HALF + c]);
      for (int m = 0; m < M; ++m) {
        const Vec xb(x[m * K + k]);
        for (int i = 0; i < NV; ++i) aq[m][i] = at::vec::fmadd(w[i], xb, aq[m][i]);
      }
    }
    // ---- stage 2: scale and zero of the group's BN rows (codes read as q)
    apply_group<M, BN, NV>(acc, aq, sz, xsum, g, G, N, n0, 8.f);
  }
  store_rows<M, BN>(acc, bias, y, N, n0);
}

// the most activation rows one pass over a block keeps in registers: aq takes M * BN / VS vectors of the 32
// (AVX-512) or 16 (AVX2) registers, a quarter of them left for the codes and x
template <int BN>
constexpr int max_rows() {
  constexpr int regs = VS >= 16 ? 16 : 12, per_row = BN / VS;
  return regs / per_row >= 4 ? 4 : (regs / per_row >= 1 ? regs / per_row : 1);
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define TS_INT4_BF16_DOT 1
// The same block for bf16 activations with AVX512-BF16 dot products: two input columns k, k+1 at once. Each code
// becomes the bf16 number 128 + q (exponent byte 0x43 over the code: exact), and vdpbf16ps adds
// x[k] (128 + q[n, k]) + x[k+1] (128 + q[n, k+1]) in fp32 (products of bf16 numbers are exact), so per group
// sum_k q x = dot - 128 sum_k x, and y[n] += scale * dot + (zero - 136 scale) * sum_k x.
// Blocks of 64 rows (AVX-512 ATen's layout) only.
template <int M>
void int4_block_bf16(const c10::BFloat16* x, const float* xsum, const uint8_t* q, const c10::BFloat16* sz,
    const c10::BFloat16* bias, c10::BFloat16* y, int64_t K, int64_t N, int64_t gs, int64_t b) {
  constexpr int BN = 64;
  const int64_t G = K / gs, n0 = b * BN;
  const uint8_t* qb = q + b * K * 32;  // [K, 32] bytes of this block
  // byte permutation: 32-bit lane r of output j takes the code of row 16 j + r (of a nibble half) at column k (byte 4r) and at k + 1
  // (byte 4r + 2); the odd bytes stay 0x43, the exponent of 128
  alignas(64) uint8_t idx_bytes[2][64];
  for (int j = 0; j < 2; ++j)
    for (int r = 0; r < 16; ++r) {
      const int row = 16 * j + r;  // rows 0..15 or 16..31 of a nibble half
      idx_bytes[j][4 * r] = uint8_t(row), idx_bytes[j][4 * r + 1] = 0;
      idx_bytes[j][4 * r + 2] = uint8_t(32 + row), idx_bytes[j][4 * r + 3] = 0;
    }
  __m512i idx[2];
  for (int j = 0; j < 2; ++j) idx[j] = _mm512_load_si512(idx_bytes[j]);
  const __mmask64 even = 0x5555555555555555ull;
  const __m512i exp128 = _mm512_set1_epi16(0x4300);
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  float acc[M][BN];
  std::memset(acc, 0, sizeof(acc));
  for (int64_t g = 0; g < G; ++g) {
    // ---- stage 1: dot products of 128 + q with x over the group, two columns per step
    Vec aq[M][4];
    for (int m = 0; m < M; ++m)
      for (int i = 0; i < 4; ++i) aq[m][i] = Vec(0.f);
    for (int64_t k = g * gs; k < (g + 1) * gs; k += 2) {
      const __m512i bytes = _mm512_loadu_si512(qb + k * 32);  // columns k (bytes 0..31) and k + 1 (32..63)
      const __m512i lo = _mm512_and_si512(bytes, low4);                         // rows 0..31
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);  // rows 32..63
      __m512bh w[4];
      w[0] = (__m512bh)_mm512_mask_permutexvar_epi8(exp128, even, idx[0], lo);
      w[1] = (__m512bh)_mm512_mask_permutexvar_epi8(exp128, even, idx[1], lo);
      w[2] = (__m512bh)_mm512_mask_permutexvar_epi8(exp128, even, idx[0], hi);
      w[3] = (__m512bh)_mm512_mask_permutexvar_epi8(exp128, even, idx[1], hi);
      for (int m = 0; m < M; ++m) {
        uint32_t pair;
        std::memcpy(&pair, x + m * K + k, sizeof(pair));  // x[m, k], x[m, k + 1]
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(int(pair));
        for (int i = 0; i < 4; ++i) aq[m][i] = _mm512_dpbf16_ps(aq[m][i], w[i], xb);
      }
    }
    // ---- stage 2: scale and zero of the group's 64 rows (codes read as the bf16 number 128 + q)
    apply_group<M, BN, 4>(acc, aq, sz, xsum, g, G, N, n0, 136.f);
  }
  store_rows<M, BN>(acc, bias, y, N, n0);
}

void int4_blocks_bf16(const c10::BFloat16* x, const float* xsum, const uint8_t* q, const c10::BFloat16* sz,
    const c10::BFloat16* bias, c10::BFloat16* y, int64_t M, int64_t K, int64_t N, int64_t gs, int64_t b0, int64_t b1) {
  by_row_groups<4>(x, xsum, y, M, K, N, K / gs, b0, b1,
                [&](auto mc, const c10::BFloat16* xm, const float* sm, c10::BFloat16* ym, int64_t b) {
                  int4_block_bf16<decltype(mc)::value>(xm, sm, q, sz, bias, ym, K, N, gs, b);
                });
}
#endif

// activation rows of every block of BN rows in [b0, b1) through the fp32 block kernel
template <int BN>
void int4_blocks(const float* x, const float* xsum, const uint8_t* q, const c10::BFloat16* sz,
                 const c10::BFloat16* bias, c10::BFloat16* y, int64_t M, int64_t K, int64_t N, int64_t gs, int64_t b0,
                 int64_t b1) {
  by_row_groups<max_rows<BN>()>(x, xsum, y, M, K, N, K / gs, b0, b1,
                                [&](auto mc, const float* xm, const float* sm, c10::BFloat16* ym, int64_t b) {
                                  int4_block<decltype(mc)::value, BN>(xm, sm, q, sz, bias, ym, K, N, gs, b);
                                });
}

// The blocks [b0, b1) of one weight in ATen's layout of bn-row blocks: x (bf16 [M, K]) through the AVX512-BF16
// dot products where they apply (bn = 64, even group size), else xf (x widened to fp32) through the fp32 blocks.
void int4_blocks_any(int64_t bn, bool dot, const c10::BFloat16* x, const float* xf, const float* xsum,
                     const uint8_t* q, const c10::BFloat16* sz, const c10::BFloat16* bias, c10::BFloat16* y, int64_t M,
                     int64_t K, int64_t N, int64_t gs, int64_t b0, int64_t b1) {
#if defined(TS_INT4_BF16_DOT)
  if (dot) return int4_blocks_bf16(x, xsum, q, sz, bias, y, M, K, N, gs, b0, b1);
#endif
  if (bn == 64) return int4_blocks<64>(xf, xsum, q, sz, bias, y, M, K, N, gs, b0, b1);
  int4_blocks<32>(xf, xsum, q, sz, bias, y, M, K, N, gs, b0, b1);
}

// whether the AVX512-BF16 dot-product blocks run for bn-row blocks and group size gs
bool int4_dot_applies(int64_t bn, int64_t gs) {
#if defined(TS_INT4_BF16_DOT)
  return bn == 64 && gs % 2 == 0;
#else
  (void)bn, (void)gs;
  return false;
#endif
}

// ATen's own kernel, the same call torchao makes: every case the GEMV does not take
at::Tensor int4_aten(const at::Tensor& x, const at::Tensor& qdata, const at::Tensor& sz, int64_t gs, int64_t N,
                     const std::optional<at::Tensor>& bias) {
  const int64_t K = x.size(-1);
  at::Tensor y = at::_weight_int4pack_mm_for_cpu(x.reshape({-1, K}).contiguous(), qdata, gs, sz);
  y = y.narrow(1, 0, N);
  if (bias.has_value() && bias->defined()) y = y + *bias;
  return y.to(x.scalar_type()).reshape(out_shape(x, N));
}

// which kernel runs the int4 linears: false the GEMV (where it applies), true ATen's own (set_int4_aten)
std::atomic<bool> int4_aten_chosen{false};

}  // namespace

void set_int4_aten(bool aten) { int4_aten_chosen.store(aten, std::memory_order_relaxed); }

bool int4_aten() { return int4_aten_chosen.load(std::memory_order_relaxed); }

int64_t aten_int4_block_n() {
  // codes q[n, k] = n / 16 for 128 rows: byte 0's high nibble holds row 32's code (2) in blocks of 64 rows, row
  // 16's (1) in blocks of 32, row 1's (0) in ATen's scalar layout (rows interleaved in pairs), which the GEMV
  // does not read
  static const int64_t bn = [] {
    try {
      const at::Tensor q = at::arange(128, at::kInt).div(16, "floor").unsqueeze(1).expand({128, 64}).contiguous();
      const at::Tensor packed = at::_convert_weight_to_int4pack_for_cpu(q, 1);
      if (packed.scalar_type() != at::kByte || packed.dim() != 2 || packed.size(0) != 128) return int64_t(0);
      const int high = packed.data_ptr<uint8_t>()[0] >> 4;
      return high == 2 ? int64_t(64) : (high == 1 ? int64_t(32) : int64_t(0));
    } catch (const std::exception&) {
      return int64_t(0);
    }
  }();
  return bn;
}

bool int4_gemv_applies(const at::Tensor& x, const at::Tensor& qdata, const at::Tensor& sz, int64_t gs, int64_t N) {
  if (!x.device().is_cpu() || !qdata.device().is_cpu() || !sz.device().is_cpu() || x.dim() < 1) return false;
  if (x.scalar_type() != at::kBFloat16) return false;  // ATen's kernel takes activations of the scales' dtype
  if (qdata.scalar_type() != at::kByte || qdata.dim() != 2 || !qdata.is_contiguous()) return false;
  if (sz.scalar_type() != at::kBFloat16 || sz.dim() != 3 || sz.size(2) != 2 || !sz.is_contiguous()) return false;
  const int64_t K = x.size(-1), bn = aten_int4_block_n();
  if (bn == 0 || K == 0 || N <= 0 || N % bn != 0 || gs <= 0 || K % gs != 0) return false;
  if (qdata.size(0) != N || qdata.size(1) * 2 != K || sz.size(0) != K / gs || sz.size(1) != N) return false;
  const int64_t M = x.numel() / K;
  return M >= 1 && M <= INT4_GEMV_MAX_ROWS;
}

namespace {
// x [M, K] bf16 (contiguous) and its per-group sums [M, G] fp32 (a few KB, on the calling thread)
std::vector<float> group_sums(const c10::BFloat16* xbp, int64_t M, int64_t K, int64_t gs) {
  const int64_t G = K / gs;
  std::vector<float> xsum(M * G);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      for (int64_t k = g * gs; k < (g + 1) * gs; ++k) s += static_cast<float>(xbp[m * K + k]);
      xsum[m * G + g] = s;
    }
  return xsum;
}
}  // namespace

at::Tensor linear_int4_group_rows(const at::Tensor& x, at::TensorList qdata, at::TensorList scale_and_zero,
                                  int64_t group_size, at::IntArrayRef out_features) {
  const size_t n = qdata.size();
  TORCH_CHECK(n > 0 && scale_and_zero.size() == n && out_features.size() == n,
              "linear_int4_group: qdata, scale_and_zero and out_features need one entry per weight, got ", n, ", ",
              scale_and_zero.size(), " and ", out_features.size());
  TORCH_CHECK(x.dim() >= 1, "linear_int4_group: x must have at least one dimension");
  const int64_t gs = group_size;
  bool ok = !int4_aten();
  for (size_t i = 0; i < n; ++i) ok = ok && int4_gemv_applies(x, qdata[i], scale_and_zero[i], gs, out_features[i]);
  std::vector<at::Tensor> out;
  if (!ok) {  // any other case: ATen's kernel per weight
    for (size_t i = 0; i < n; ++i) out.push_back(int4_aten(x, qdata[i], scale_and_zero[i], gs, out_features[i], std::nullopt));
    return at::cat(out, -1);
  }
  const int64_t K = x.size(-1), M = x.numel() / K;
  // ---- stage 1: x [M, K] bf16 and its group sums, once for every weight
  const at::Tensor xb = x.reshape({M, K}).contiguous();
  const c10::BFloat16* xbp = xb.data_ptr<c10::BFloat16>();
  const std::vector<float> xsum = group_sums(xbp, M, K, gs);
  std::vector<int64_t> start(n + 1, 0);  // weight i holds blocks [start[i], start[i + 1]) of the union
  const int64_t bn = aten_int4_block_n();
  for (size_t i = 0; i < n; ++i) start[i + 1] = start[i] + out_features[i] / bn;
  std::vector<c10::BFloat16*> yp;
  at::Tensor y = side_by_side(M, out_features, x.options(), out, yp);  // [M, sum N_i] bf16
  // ---- stage 2: blocks of bn output rows of every weight, one parallel region
  const int64_t grain = std::max<int64_t>(1, MIN_TASK_BYTES / std::max<int64_t>(1, K * bn / 2));
  const bool dot = int4_dot_applies(bn, gs);
  const at::Tensor xf = dot ? at::Tensor() : xb.to(at::kFloat);  // [M, K] fp32 for the widening path
  const float* xfp = dot ? nullptr : xf.data_ptr<float>();
  at::parallel_for(0, start.back(), grain, [&](int64_t a, int64_t b) {
    for (size_t i = 0; i < n; ++i) {
      const int64_t lo = std::max(a, start[i]) - start[i], hi = std::min(b, start[i + 1]) - start[i];
      if (lo >= hi) continue;
      int4_blocks_any(bn, dot, xbp, xfp, xsum.data(), qdata[i].data_ptr<uint8_t>(),
                      scale_and_zero[i].data_ptr<c10::BFloat16>(), nullptr, yp[i], M, K, out_features[i], gs, lo, hi);
    }
  });
  if (M > 1) at::cat_out(y, out, 1);
  return y.view(out_shape(x, -1));  // [..., sum N_i] bf16
}

at::Tensor linear_int4_rows(const at::Tensor& x, const at::Tensor& qdata, const at::Tensor& scale_and_zero,
                            int64_t group_size, int64_t out_features, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() >= 1, "linear_int4: x must have at least one dimension");
  const int64_t N = out_features, gs = group_size;
  const bool has_bias = bias.has_value() && bias->defined();
  const bool bias_ok = !has_bias || (bias->device().is_cpu() && bias->scalar_type() == at::kBFloat16 &&
                                     bias->dim() == 1 && bias->size(0) == N);
  if (!bias_ok || int4_aten() || !int4_gemv_applies(x, qdata, scale_and_zero, gs, N))
    return int4_aten(x, qdata, scale_and_zero, gs, N, bias);
  const int64_t K = x.size(-1), M = x.numel() / K;
  // ---- stage 1: x [M, K] bf16 and its per-group sums xsum [M, K / gs] fp32 (group_sums)
  const at::Tensor xb = x.reshape({M, K}).contiguous();
  const c10::BFloat16* xbp = xb.data_ptr<c10::BFloat16>();
  const std::vector<float> xsum = group_sums(xbp, M, K, gs);
  at::Tensor bc;
  if (has_bias) bc = bias->contiguous();
  const c10::BFloat16* bp = has_bias ? bc.data_ptr<c10::BFloat16>() : nullptr;
  at::Tensor y = at::empty(out_shape(x, N), x.options());  // [..., N] bf16
  const float* sp = xsum.data();
  const uint8_t* qp = qdata.data_ptr<uint8_t>();
  const c10::BFloat16* zp = scale_and_zero.data_ptr<c10::BFloat16>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  // ---- stage 2: blocks of bn output rows, one contiguous range per thread
  const int64_t bn = aten_int4_block_n(), nb = N / bn;
  const int64_t grain = std::max<int64_t>(1, MIN_TASK_BYTES / std::max<int64_t>(1, K * bn / 2));
  const bool dot = int4_dot_applies(bn, gs);  // AVX512-BF16 dot products over column pairs
  const at::Tensor xf = dot ? at::Tensor() : xb.to(at::kFloat);  // [M, K] fp32 for the widening path
  const float* xfp = dot ? nullptr : xf.data_ptr<float>();
  at::parallel_for(0, nb, grain, [&](int64_t b0, int64_t b1) {
    int4_blocks_any(bn, dot, xbp, xfp, sp, qp, zp, bp, yp, M, K, N, gs, b0, b1);
  });
  return y;
}

}  // namespace tinyserve_native
