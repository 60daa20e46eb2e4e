// The draw certificate's one pass over the whole vocabulary, fused: which tokens' Gumbel noise
// may lift them to the row's threshold (vllm_csv/sampling/certificate.py, vllm_csv/ops/noise.py).
//
// For each row r and column c with hi[r, c] > -inf, with token id tok = ids[r, c] (or c):
//   bits = splitmix64(splitmix64(seed_r) + (tok + 1) * 0x9E3779B97F4A7C15) >> 11   (uint64)
//   gap  = clamp(floor((double(hmax_r) - double(hi[r, c])) * inv_level), 0, levels)
//   keep = bits >= table[r, gap]
// and every column listed in force[r] (-1: none). The torch reference
// (vllm_csv.ops.noise.noise_candidates_ref) hashes with the same uint64 arithmetic and takes
// the same float64 operations (a difference of two fp32 values, a product by a power of two,
// floor), so the lists are identical. Output: (row, column, bits) of every kept token, row by
// row, columns ascending (the order of torch.nonzero).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace {

constexpr uint64_t GOLDEN = 0x9E3779B97F4A7C15ULL;  // vllm_csv.sampling.gumbel.GOLDEN

inline uint64_t splitmix64(uint64_t z) {  // vllm_csv.sampling.gumbel.splitmix64
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

constexpr int64_t CHUNK = 256;  // tokens a chunk: one branch-free loop the compiler vectorises

// keep[j] for the chunk's tokens (module comment), without the forced columns; bits into out
template <bool CONTIGUOUS>
inline void chunk_keep(uint64_t key, int64_t id0, const int64_t* ids, const float* h, double hm, double inv_level,
                       const int64_t* table, int64_t levels, int64_t m, int64_t* out, uint8_t* keep) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const double top = static_cast<double>(levels);
  for (int64_t j = 0; j < m; ++j) {
    const uint64_t id = static_cast<uint64_t>(CONTIGUOUS ? id0 + j : ids[j]);
    const int64_t b = static_cast<int64_t>(splitmix64(key + (id + 1) * GOLDEN) >> 11);
    const bool live = h[j] > neg_inf;  // -inf (and NaN, which the caller's rows do not have): not kept
    double g = std::floor((hm - static_cast<double>(h[j])) * inv_level);
    g = live ? std::min(std::max(g, 0.0), top) : top;
    out[j] = b;
    keep[j] = live & (b >= table[static_cast<int64_t>(g)]);
  }
}

#define CHUNK_ARGS uint64_t key, int64_t id0, const int64_t *ids, const float *h, double hm, double inv_level, \
                   const int64_t *table, int64_t levels, int64_t m, int64_t *out, uint8_t *keep
#define CHUNK_CALL(C) chunk_keep<C>(key, id0, ids, h, hm, inv_level, table, levels, m, out, keep)

__attribute__((target("avx512f,avx512dq"))) void chunk_keep_avx512(CHUNK_ARGS) {
  if (ids) CHUNK_CALL(false);
  else CHUNK_CALL(true);
}

void chunk_keep_any(CHUNK_ARGS) {
  if (ids) CHUNK_CALL(false);
  else CHUNK_CALL(true);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> noise_candidates(const at::Tensor& hi_in, const at::Tensor& seeds_in,
                                                                const at::Tensor& hmax_in, const at::Tensor& table_in,
                                                                const at::Tensor& force_in,
                                                                const c10::optional<at::Tensor>& ids_in,
                                                                double inv_level) {
  TORCH_CHECK(hi_in.dim() == 2 && hi_in.scalar_type() == at::kFloat && hi_in.device().is_cpu(),
              "noise_candidates: hi [R, n] float32 on the CPU");
  at::Tensor hi = hi_in.contiguous();
  const int64_t R = hi.size(0), n = hi.size(1);
  at::Tensor seeds = seeds_in.to(at::kLong).contiguous(), hmax = hmax_in.to(at::kFloat).contiguous();
  at::Tensor table = table_in.to(at::kLong).contiguous(), force = force_in.to(at::kLong).contiguous();
  TORCH_CHECK(seeds.numel() == R && hmax.numel() == R, "noise_candidates: seeds and hmax [R]");
  TORCH_CHECK(table.dim() == 2 && table.size(0) == R && table.size(1) >= 1, "noise_candidates: table [R, levels + 1]");
  TORCH_CHECK(force.dim() == 2 && force.size(0) == R, "noise_candidates: force [R, k]");
  at::Tensor ids;
  if (ids_in.has_value()) {
    ids = ids_in->to(at::kLong).contiguous();
    TORCH_CHECK(ids.sizes() == hi.sizes(), "noise_candidates: ids [R, n] like hi");
  }
  const int64_t levels = table.size(1) - 1, nf = force.size(1);
  const float* hp = hi.data_ptr<float>();
  const int64_t* sp = seeds.data_ptr<int64_t>();
  const float* mp = hmax.data_ptr<float>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* fp = force.data_ptr<int64_t>();
  const int64_t* ip = ids.defined() ? ids.data_ptr<int64_t>() : nullptr;

  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  std::vector<std::vector<int64_t>> cols(R), bits(R);
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* h = hp + r * n;
      const int64_t* tr = tp + r * (levels + 1);
      const int64_t* tok = ip ? ip + r * n : nullptr;
      const uint64_t key = splitmix64(static_cast<uint64_t>(sp[r]));
      const double hm = static_cast<double>(mp[r]);
      std::vector<int64_t> fr;  // forced columns, ascending
      for (int64_t j = 0; j < nf; ++j)
        if (fp[r * nf + j] >= 0) fr.push_back(fp[r * nf + j]);
      std::sort(fr.begin(), fr.end());
      size_t next = 0;
      std::vector<int64_t>& cr = cols[r];
      std::vector<int64_t>& br = bits[r];
      int64_t buf[CHUNK];
      uint8_t keep[CHUNK];
      for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
        const int64_t m = std::min(CHUNK, n - c0);
        (avx512 ? chunk_keep_avx512 : chunk_keep_any)(key, c0, tok ? tok + c0 : nullptr, h + c0, hm, inv_level, tr,
                                                      levels, m, buf, keep);
        for (; next < fr.size() && fr[next] < c0 + m; ++next)
          if (fr[next] >= c0) keep[fr[next] - c0] = 1;
        for (int64_t j = 0; j < m; ++j)
          if (keep[j]) {
            cr.push_back(c0 + j);
            br.push_back(buf[j]);
          }
      }
    }
  });
  int64_t m = 0;
  for (int64_t r = 0; r < R; ++r) m += static_cast<int64_t>(cols[r].size());
  auto opt = seeds.options();
  at::Tensor ri = at::empty({m}, opt), ci = at::empty({m}, opt), bo = at::empty({m}, opt);
  int64_t *rp = ri.data_ptr<int64_t>(), *cp = ci.data_ptr<int64_t>(), *bp = bo.data_ptr<int64_t>();
  for (int64_t r = 0, k = 0; r < R; ++r)
    for (size_t j = 0; j < cols[r].size(); ++j, ++k) {
      rp[k] = r;
      cp[k] = cols[r][j];
      bp[k] = bits[r][j];
    }
  return {ri, ci, bo};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_csv_cpu, m) {
  m.def("noise_candidates(Tensor hi, Tensor seeds, Tensor hmax, Tensor table, Tensor force, Tensor? ids, "
        "float inv_level) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(vllm_csv_cpu, CPU, m) { m.impl("noise_candidates", &noise_candidates); }
