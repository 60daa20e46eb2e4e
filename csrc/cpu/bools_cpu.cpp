// The flat positions of the true elements of a bool tensor, ascending (reference:
// x.reshape(-1).nonzero().squeeze(1); vllm_csv/ops/bools.py flat_nonzero_ref).
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_csv_cpu, m) { m.def("flat_nonzero(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(vllm_csv_cpu, CPU, m) { m.impl("flat_nonzero", &flat_nonzero); }
