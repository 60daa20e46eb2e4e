// A row's interval statistics and its live columns, each in one pass over the bounds lo, hi
// ([R, n] float32) of a sampled row (vllm_csv/sampling/certificate.py, vllm_csv/ops/live.py):
//
// * row_stats: what the draw certificate and min-p read first of a row: max lo, max hi, the
//   largest magnitude, the live count and the k largest lo;
// * pack_live: each row's live columns (hi != -inf, or lo NaN), packed, for the packed
//   certificate.
//
// Why fused: the torch references take seven passes (row_stats, topk the dearest) and a nonzero
// over [R, V] bool masks (pack_live, a scalar loop in torch on the CPU), about 1 ms and 0.5 ms
// for 8 rows of 65536 tokens on 2 cores; each kernel is one vectorised pass. Max, min, negation
// and comparisons are exact: the same numbers as the references (row_stats says where a tie or
// the sign of a zero may go another way).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "isa.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace {

// Statistics of one chunk of a row (row_stats below), branch-free so the compiler vectorises it.
struct ChunkStats {
  float lmx, hmx, lmn, hmn, cmax;
  int32_t nan_lo, nan_hi, live;
};

template <int DUMMY>
inline void chunk_stats(const float* x, const float* y, int64_t m, ChunkStats& s) {
  const float inf = std::numeric_limits<float>::infinity();
  float lmx = -inf, hmx = -inf, lmn = inf, hmn = inf;
  int32_t nl = 0, nh = 0, live = 0;
  // the order of the reductions is free: max and min of non-NaN values (NaN is never taken, and
  // counted), integer sums; only the sign of a zero extremum may differ, which no caller reads
#pragma omp simd reduction(max : lmx, hmx) reduction(min : lmn, hmn) reduction(+ : nl, nh, live)
  for (int64_t j = 0; j < m; ++j) {
    const float a = x[j], b = y[j];
    nl += a != a;
    nh += b != b;
    live += (b != -inf) | (a != a);
    lmx = a > lmx ? a : lmx;  // NaN never taken (counted above)
    hmx = b > hmx ? b : hmx;
    const float a0 = a == -inf ? 0.0f : a, b0 = b == -inf ? 0.0f : b;
    lmn = a0 < lmn ? a0 : lmn;
    hmn = b0 < hmn ? b0 : hmn;
  }
  s = {lmx, hmx, lmn, hmn, lmx, nl, nh, live};
}

__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl"))) void chunk_stats_avx512(const float* x, const float* y,
                                                                                      int64_t m, ChunkStats& s) {
  chunk_stats<0>(x, y, m, s);
}

__attribute__((target("avx2"))) void chunk_stats_avx2(const float* x, const float* y, int64_t m, ChunkStats& s) {
  chunk_stats<1>(x, y, m, s);
}

void chunk_stats_any(const float* x, const float* y, int64_t m, ChunkStats& s) { chunk_stats<2>(x, y, m, s); }

// One pass over a row's bounds lo, hi ([R, n] float32) for what the draw certificate reads first
// (vllm_csv.ops.live.row_stats_ref): lmax = max lo, hmax = max hi (NaN if the row has one, as
// torch's amax); absmax = max(|hmax|, -min lo, -min hi) with -inf counted as 0 (rows without NaN
// or +inf); live = #{j: hi_j != -inf or lo_j is NaN}; the k largest lo (descending, ties to the
// lowest index; -inf entries, at column 0, where fewer than k are above -inf). Max, min and
// negation are exact, so the numbers are the reference's bit for bit.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> row_stats(const at::Tensor& lo_in,
                                                                                              const at::Tensor& hi_in,
                                                                                              int64_t k) {
  TORCH_CHECK(lo_in.dim() == 2 && lo_in.scalar_type() == at::kFloat && lo_in.device().is_cpu() &&
                  hi_in.sizes() == lo_in.sizes() && hi_in.scalar_type() == at::kFloat && hi_in.device().is_cpu(),
              "row_stats: lo, hi [R, n] float32 on the CPU");
  at::Tensor lo = lo_in.contiguous(), hi = hi_in.contiguous();
  const int64_t R = lo.size(0), n = lo.size(1);
  TORCH_CHECK(k >= 1 && k <= 16 && k <= n, "row_stats: 1 <= k <= min(16, n)");
  auto f32 = lo.options();
  at::Tensor lmax = at::empty({R}, f32), hmax = at::empty({R}, f32), absmax = at::empty({R}, f32);
  at::Tensor live = at::empty({R}, f32.dtype(at::kLong)), tv = at::empty({R, k}, f32), ti = at::empty({R, k}, f32.dtype(at::kLong));
  const float* lp = lo.data_ptr<float>();
  const float* hp = hi.data_ptr<float>();
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  static const auto stats_fn = CSV_CPU_SUPPORTS("avx512bw") && CSV_CPU_SUPPORTS("avx512vl")
                                   ? chunk_stats_avx512
                                   : (CSV_CPU_SUPPORTS("avx2") ? chunk_stats_avx2 : chunk_stats_any);
  constexpr int64_t SCH = 4096;  // tokens a chunk: statistics in registers, then the top check
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = lp + r * n;
      const float* y = hp + r * n;
      float lmx = -inf, hmx = -inf, lmn = inf, hmn = inf;
      int64_t cnt = 0, nl = 0, nh = 0;
      float topv[16];
      int64_t topi[16];
      for (int64_t j = 0; j < k; ++j) topv[j] = -inf, topi[j] = -1;
      for (int64_t c0 = 0; c0 < n; c0 += SCH) {
        const int64_t m = std::min(SCH, n - c0);
        ChunkStats cs;
        stats_fn(x + c0, y + c0, m, cs);
        lmx = std::max(lmx, cs.lmx), hmx = std::max(hmx, cs.hmx), lmn = std::min(lmn, cs.lmn);
        hmn = std::min(hmn, cs.hmn), cnt += cs.live, nl += cs.nan_lo, nh += cs.nan_hi;
        if (!(cs.cmax > topv[k - 1])) continue;
        for (int64_t j = 0; j < m; ++j) {  // a chunk that enters the top: insert in order
          const float a = x[c0 + j];
          if (!(a > topv[k - 1])) continue;
          int64_t p = k - 1;
          while (p > 0 && a > topv[p - 1]) {  // strict: an equal value found earlier stays first
            topv[p] = topv[p - 1];
            topi[p] = topi[p - 1];
            --p;
          }
          topv[p] = a;
          topi[p] = c0 + j;
        }
      }
      const float hm = nh ? nan : hmx;
      lmax.data_ptr<float>()[r] = nl ? nan : lmx;
      hmax.data_ptr<float>()[r] = hm;
      absmax.data_ptr<float>()[r] = std::max(std::fabs(hm), std::max(-lmn, -hmn));
      live.data_ptr<int64_t>()[r] = cnt;
      for (int64_t j = 0; j < k; ++j) {
        tv.data_ptr<float>()[r * k + j] = topv[j];
        ti.data_ptr<int64_t>()[r * k + j] = topi[j] < 0 ? 0 : topi[j];
      }
    }
  });
  return {lmax, hmax, absmax, live, tv, ti};
}

// Columns j0.. of a row that are live, one by one, after k already found (-1: more than cap).
inline int64_t live_cols_from(const float* lo, const float* hi, int64_t j0, int64_t m, int64_t* out, int64_t k,
                              int64_t cap) {
  for (int64_t j = j0; j < m; ++j)
    if (hi[j] != -std::numeric_limits<float>::infinity() || lo[j] != lo[j]) {
      if (k == cap) return -1;
      out[k++] = j;
    }
  return k;
}

// Each row's live columns (hi != -inf, or lo NaN: vllm_csv.ops.live.pack_live_ref) in column
// order, into [R, n] int64, padded with n_cols (the row length). Compare 16 (8) columns at a
// time, then walk the set bits: rows are mostly dead once min-p / top-k dropped their tails.
__attribute__((target("avx512f"))) int64_t live_cols_avx512(const float* lo, const float* hi, int64_t m,
                                                            int64_t* out, int64_t cap) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t k = 0, j = 0;
  for (; j + 16 <= m; j += 16) {
    const __m512 h = _mm512_loadu_ps(hi + j), l = _mm512_loadu_ps(lo + j);
    uint32_t bits = _mm512_cmp_ps_mask(h, ninf, _CMP_NEQ_UQ) | _mm512_cmp_ps_mask(l, l, _CMP_UNORD_Q);
    for (; bits; bits &= bits - 1) {
      if (k == cap) return -1;
      out[k++] = j + __builtin_ctz(bits);
    }
  }
  return live_cols_from(lo, hi, j, m, out, k, cap);
}

__attribute__((target("avx2"))) int64_t live_cols_avx2(const float* lo, const float* hi, int64_t m, int64_t* out,
                                                       int64_t cap) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t k = 0, j = 0;
  for (; j + 8 <= m; j += 8) {
    const __m256 h = _mm256_loadu_ps(hi + j), l = _mm256_loadu_ps(lo + j);
    uint32_t bits = static_cast<uint32_t>(
        _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(h, ninf, _CMP_NEQ_UQ), _mm256_cmp_ps(l, l, _CMP_UNORD_Q))));
    for (; bits; bits &= bits - 1) {
      if (k == cap) return -1;
      out[k++] = j + __builtin_ctz(bits);
    }
  }
  return live_cols_from(lo, hi, j, m, out, k, cap);
}

int64_t live_cols_any(const float* lo, const float* hi, int64_t m, int64_t* out, int64_t cap) {
  return live_cols_from(lo, hi, 0, m, out, 0, cap);
}

at::Tensor pack_live(const at::Tensor& lo_in, const at::Tensor& hi_in, int64_t n) {
  TORCH_CHECK(lo_in.dim() == 2 && lo_in.scalar_type() == at::kFloat && lo_in.device().is_cpu() &&
                  hi_in.sizes() == lo_in.sizes() && hi_in.scalar_type() == at::kFloat && hi_in.device().is_cpu(),
              "pack_live: lo, hi [R, V] float32 on the CPU");
  TORCH_CHECK(n >= 0, "pack_live: n >= 0");
  at::Tensor lo = lo_in.contiguous(), hi = hi_in.contiguous();
  const int64_t R = lo.size(0), V = lo.size(1);
  at::Tensor cols = at::full({R, n}, V, lo.options().dtype(at::kLong));
  const float *lp = lo.data_ptr<float>(), *hp = hi.data_ptr<float>();
  int64_t* cp = cols.data_ptr<int64_t>();
  static const auto fn = CSV_CPU_SUPPORTS("avx512f")
                             ? live_cols_avx512
                             : (CSV_CPU_SUPPORTS("avx2") ? live_cols_avx2 : live_cols_any);
  std::vector<int64_t> counts(R);
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) counts[r] = fn(lp + r * V, hp + r * V, V, cp + r * n, n);
  });
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(counts[r] >= 0, "pack_live: a row has more than n live columns");
  return cols;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_csv_cpu, m) {
  m.def("row_stats(Tensor lo, Tensor hi, int k) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("pack_live(Tensor lo, Tensor hi, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_csv_cpu, CPU, m) {
  m.impl("row_stats", &row_stats);
  m.impl("pack_live", &pack_live);
}
