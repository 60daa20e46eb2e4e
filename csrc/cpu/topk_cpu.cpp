// The k largest values of each row and their columns, one filtered pass a row (reference: torch.topk,
// vllm_csv/ops/topk.py row_topk_ref).
//
// For each row of x ([R, n] float32): out values [R, k] descending, indices [R, k] int64, ranked as torch
// ranks them (NaN above every number, NaNs equal; -0.0 == +0.0), ties between equal values to the lower
// column (torch leaves their order unspecified). The values are the reference's bit for bit, up to the
// sign of a zero among equal zeros.
//
// Why a kernel: torch.topk on this build takes about 45 us a row of 65536 (350 us for 8 rows on 2 cores)
// whatever k; the certified step calls it several times a step. Here each row is scanned once in blocks
// of 16: a block is read further only if one of its values may enter the current k best (x >= the k-th
// best kept so far, or NaN), which after the first few blocks is rare; the kept candidates are cut back
// to the k best (nth_element) when their buffer fills, and sorted at the end.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "isa.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t BLK = 16;

// a ranks before b: the larger value (NaN largest), then the lower column
struct Before {
  const float* x;
  bool operator()(int64_t a, int64_t b) const {
    const float va = x[a], vb = x[b];
    const bool na = va != va, nb = vb != vb;
    if (na || nb) return na && nb ? a < b : na;
    if (va != vb) return va > vb;
    return a < b;
  }
};

// a block of 16 may hold a value that enters the k best kept so far: x >= t (t their worst) or NaN
template <int DUMMY>
inline bool block_may_enter(const float* x, float t) {
  int any = 0;
#pragma omp simd reduction(| : any)
  for (int64_t j = 0; j < BLK; ++j) any |= (x[j] >= t) | (x[j] != x[j]);
  return any != 0;
}

template <int DUMMY>
inline void top_row(const float* x, int64_t n, int64_t k, float* ov, int64_t* oi, std::vector<int64_t>& cand) {
  const Before before{x};
  const int64_t cap = std::max<int64_t>(2 * k, 256);
  cand.clear();
  float t = -std::numeric_limits<float>::infinity();
  bool full = false;  // until the first cut every value is kept
  auto shrink = [&]() {  // keep the k best; t = the k-th best's value (NaN: only NaNs may enter)
    std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.end(), before);
    cand.resize(k);
    t = x[cand[k - 1]];
    full = true;
  };
  int64_t j = 0;
  for (; j + BLK <= n; j += BLK) {
    if (full && !block_may_enter<DUMMY>(x + j, t)) continue;
    for (int64_t i = j; i < j + BLK; ++i)
      if (!full || x[i] >= t || x[i] != x[i]) cand.push_back(i);
    if (static_cast<int64_t>(cand.size()) >= cap) shrink();
  }
  for (; j < n; ++j)
    if (!full || x[j] >= t || x[j] != x[j]) cand.push_back(j);
  if (static_cast<int64_t>(cand.size()) > k) shrink();
  std::sort(cand.begin(), cand.end(), before);
  for (int64_t i = 0; i < k; ++i) {
    oi[i] = cand[i];
    ov[i] = x[cand[i]];
  }
}

using RowFn = void (*)(const float*, int64_t, int64_t, float*, int64_t*, std::vector<int64_t>&);

__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl"))) void top_row_avx512(
    const float* x, int64_t n, int64_t k, float* ov, int64_t* oi, std::vector<int64_t>& cand) {
  top_row<0>(x, n, k, ov, oi, cand);
}
__attribute__((target("avx2"))) void top_row_avx2(const float* x, int64_t n, int64_t k, float* ov, int64_t* oi,
                                                  std::vector<int64_t>& cand) {
  top_row<1>(x, n, k, ov, oi, cand);
}
void top_row_any(const float* x, int64_t n, int64_t k, float* ov, int64_t* oi, std::vector<int64_t>& cand) {
  top_row<2>(x, n, k, ov, oi, cand);
}

std::tuple<at::Tensor, at::Tensor> row_topk(const at::Tensor& x_in, int64_t k) {
  static const RowFn top = CSV_CPU_SUPPORTS("avx512bw") && CSV_CPU_SUPPORTS("avx512vl")
                               ? top_row_avx512
                               : (CSV_CPU_SUPPORTS("avx2") ? top_row_avx2 : top_row_any);
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "row_topk: x [R, n] float32 on the CPU");
  const int64_t R = x_in.size(0), n = x_in.size(1);
  TORCH_CHECK(k >= 0 && k <= n, "row_topk: k = ", k, " outside [0, ", n, "]");
  const at::Tensor x = x_in.contiguous();
  at::Tensor values = at::empty({R, k}, x.options()), indices = at::empty({R, k}, x.options().dtype(at::kLong));
  if (k == 0 || R == 0) return {values, indices};
  const float* xp = x.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> cand;
    cand.reserve(std::max<int64_t>(2 * k, 256) + BLK);
    for (int64_t r = r0; r < r1; ++r) top(xp + r * n, n, k, vp + r * k, ip + r * k, cand);
  });
  return {values, indices};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_csv_cpu, m) { m.def("row_topk(Tensor x, int k) -> (Tensor, Tensor)"); }

TORCH_LIBRARY_IMPL(vllm_csv_cpu, CPU, m) { m.impl("row_topk", &row_topk); }
