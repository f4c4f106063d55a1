// Read-bandwidth probe for bench/ceilings.py: sums the float32 contents of chunks of a buffer, the chunks given by
// byte offsets, split over threads with at::parallel_for. A measurement tool of the benchmarks, not a kernel of the
// backend: it shows what this machine's memory gives the access patterns of the sparse op (whole pages, single
// rows, in ascending order) against a sequential read.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/extension.h>

namespace {

using Vec = at::vec::Vectorized<float>;

// sum of the float32 values of chunks [i0, i1) of `chunk` bytes at base + off[i], software-prefetching the chunk
// `ahead` chunks later into L2 (ahead = 0: none)
float sum_chunks(const char* base, const int64_t* off, int64_t i0, int64_t i1, int64_t chunk, int64_t ahead) {
  Vec acc0(0.f), acc1(0.f);
  const int64_t nf = chunk / static_cast<int64_t>(sizeof(float));
  for (int64_t i = i0; i < i1; ++i) {
    if (ahead > 0 && i + ahead < i1) {
      const char* p = base + off[i + ahead];
      for (int64_t b = 0; b < chunk; b += 64) __builtin_prefetch(p + b, 0, 2);
    }
    const float* x = reinterpret_cast<const float*>(base + off[i]);
    int64_t j = 0;
    for (; j + 2 * Vec::size() <= nf; j += 2 * Vec::size()) {
      acc0 = acc0 + Vec::loadu(x + j);
      acc1 = acc1 + Vec::loadu(x + j + Vec::size());
    }
    for (; j + Vec::size() <= nf; j += Vec::size()) acc0 = acc0 + Vec::loadu(x + j);
  }
  float out[Vec::size()];
  (acc0 + acc1).store(out);
  float s = 0.f;
  for (int k = 0; k < Vec::size(); ++k) s += out[k];
  return s;
}

// sum over every chunk, the chunk list split into one contiguous range per thread
double read_chunks(const at::Tensor& buf, const at::Tensor& offsets, int64_t chunk, int64_t ahead) {
  TORCH_CHECK(buf.is_contiguous() && buf.device().is_cpu(), "gather_probe: buf must be a contiguous CPU tensor");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.is_contiguous(), "gather_probe: offsets must be int64");
  TORCH_CHECK(chunk > 0 && chunk % 64 == 0, "gather_probe: chunk must be a positive multiple of 64 bytes");
  const char* base = static_cast<const char*>(buf.data_ptr());
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t n = offsets.numel(), nbytes = buf.numel() * buf.element_size();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(off[i] >= 0 && off[i] + chunk <= nbytes, "gather_probe: offset ", off[i], " out of the buffer");
  const int nt = at::get_num_threads();
  std::vector<double> part(nt, 0.0);
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      part[t] = sum_chunks(base, off, n * t / nt, n * (t + 1) / nt, chunk, ahead);
  });
  double s = 0.0;
  for (double x : part) s += x;
  return s;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("read_chunks", &read_chunks, "sum of the float32 values of the chunks at the given byte offsets");
}
