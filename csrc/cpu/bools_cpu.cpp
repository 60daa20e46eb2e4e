// The flat positions of the true elements of a bool tensor, ascending (reference:
// x.reshape(-1).nonzero().squeeze(1); vllm_csv/ops/bools.py flat_nonzero_ref). And the number of
// -inf of each row of a float tensor (neg_inf_rows, at the end).
//
// Why a kernel: torch.nonzero on this CPU build takes about 2.8 ms over a [32, 65536] bool mask
// with a few thousand true elements (0.2 ms when none is true), and the top-p certificate takes
// one such pass each time it decides a set of tokens. Here the mask is read 8 bytes at a time
// (a torch bool is one byte), twice: each chunk counts its true elements (the sum of its
// words' bytes), then, after a prefix sum over the chunks, writes their positions; words that
// are zero are skipped.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t CHUNK = 1 << 16;  // elements a task

// bit 8j of the result: byte j of p[0, 8) is nonzero (a bool holding another byte than 0 or 1,
// made by a view, counts as true, as torch reads it, and cannot break the two passes' agreement)
inline uint64_t word_at(const uint8_t* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);
  w |= w >> 4;
  w |= w >> 2;
  w |= w >> 1;
  return w & 0x0101010101010101ULL;
}

// true elements of p[0, n) (each byte 0 or 1)
int64_t count(const uint8_t* p, int64_t n) {
  int64_t c = 0, i = 0;
  for (; i + 8 <= n; i += 8) c += (word_at(p + i) * 0x0101010101010101ULL) >> 56;  // its bytes' sum (<= 8)
  for (; i < n; ++i) c += p[i] != 0;
  return c;
}

// writes base + the positions of p[0, n)'s true elements to out, ascending
void positions(const uint8_t* p, int64_t n, int64_t base, int64_t* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w = word_at(p + i);
    while (w) {  // little-endian: byte j of the word is element i + j
      const int j = __builtin_ctzll(w) >> 3;
      *out++ = base + i + j;
      w &= w - 1;
    }
  }
  for (; i < n; ++i)
    if (p[i]) *out++ = base + i;
}

at::Tensor flat_nonzero(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.scalar_type() == at::kBool && x_in.device().is_cpu(), "flat_nonzero: a bool tensor on the CPU");
  const at::Tensor x = x_in.contiguous();
  const int64_t n = x.numel();
  const uint8_t* p = reinterpret_cast<const uint8_t*>(x.data_ptr<bool>());
  const int64_t chunks = (n + CHUNK - 1) / CHUNK;
  std::vector<int64_t> start(chunks + 1, 0);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) start[c + 1] = count(p + c * CHUNK, std::min(CHUNK, n - c * CHUNK));
  });
  for (int64_t c = 0; c < chunks; ++c) start[c + 1] += start[c];
  at::Tensor out = at::empty({start[chunks]}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      if (start[c + 1] > start[c]) positions(p + c * CHUNK, std::min(CHUNK, n - c * CHUNK), c * CHUNK, op + start[c]);
  });
  return out;
}

// -inf elements of p[0, n): equal bit patterns (a NaN, whatever its bits, is not -inf; -0.0 and
// subnormals are not either), a loop the compiler vectorises
template <typename U>
int64_t count_bits(const U* p, int64_t n, U neg_inf) {
  int64_t c = 0;
  for (int64_t i = 0; i < n; ++i) c += p[i] == neg_inf;
  return c;
}

// [R] int64: the -inf elements of each row of x [R, V] (float32, bfloat16 or float16). Reference:
// (x == -inf).sum(1) (vllm_csv/ops/bools.py neg_inf_rows_ref). Why a kernel: the sampler checks,
// each step, that a model which suppresses tokens after the head set exactly those to -inf on
// the deferred rows; torch's comparison, then its bool reductions, read and write [R, V] three
// times (about 2 ms for 8 rows of 65536 on one thread), one pass of 16- or 32-bit loads here.
at::Tensor neg_inf_rows(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.device().is_cpu(), "neg_inf_rows: a 2-D tensor on the CPU");
  const auto dt = x_in.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, "neg_inf_rows: float32, bfloat16 or float16");
  const at::Tensor x = x_in.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({R}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (dt == at::kFloat) {
        op[r] = count_bits(reinterpret_cast<const uint32_t*>(x.data_ptr<float>()) + r * V, V, uint32_t(0xFF800000u));
      } else {
        const uint16_t* p = reinterpret_cast<const uint16_t*>(x.data_ptr()) + r * V;
        op[r] = count_bits(p, V, uint16_t(dt == at::kBFloat16 ? 0xFF80u : 0xFC00u));
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_csv_cpu, m) {
  m.def("flat_nonzero(Tensor x) -> Tensor");
  m.def("neg_inf_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_csv_cpu, CPU, m) {
  m.impl("flat_nonzero", &flat_nonzero);
  m.impl("neg_inf_rows", &neg_inf_rows);
}
