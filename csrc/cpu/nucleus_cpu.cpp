// vLLM's min-p mask on bounds, one pass (vllm_csv/sampling/nucleus.py: min_p_bounds; the torch
// reference is vllm_csv.ops.masks.min_p_cut_ref).
//
// For each row r and column c of lo, hi ([R, n] float32), with the row's thresholds keep_at[r],
// drop_at[r] (float32; NaN: never):
//   new_lo = lo >= keep_at ? lo : -inf                  (certainly kept: its lower bound stays)
//   new_hi = (hi < drop_at && lo > -inf) ? -inf : hi    (certainly dropped)
// Comparisons only: the outputs are the reference's bit for bit. Why a kernel: torch's where and
// masked_fill on this build run a scalar loop over bool masks (about 0.7 ms each for 8 rows of
// 65536 tokens on 2 cores, where one vectorised pass takes 30 us).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>

namespace {

template <int DUMMY>
inline void cut_row(const float* lo, const float* hi, float* olo, float* ohi, int64_t n, float keep_at,
                    float drop_at) {
  const float ninf = -std::numeric_limits<float>::infinity();
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float a = lo[j], b = hi[j];
    olo[j] = a >= keep_at ? a : ninf;
    ohi[j] = (b < drop_at) & (a > ninf) ? ninf : b;
  }
}

__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl"))) void cut_row_avx512(const float* lo, const float* hi,
                                                                                   float* olo, float* ohi, int64_t n,
                                                                                   float keep_at, float drop_at) {
  cut_row<0>(lo, hi, olo, ohi, n, keep_at, drop_at);
}

__attribute__((target("avx2"))) void cut_row_avx2(const float* lo, const float* hi, float* olo, float* ohi, int64_t n,
                                                  float keep_at, float drop_at) {
  cut_row<1>(lo, hi, olo, ohi, n, keep_at, drop_at);
}

void cut_row_any(const float* lo, const float* hi, float* olo, float* ohi, int64_t n, float keep_at, float drop_at) {
  cut_row<2>(lo, hi, olo, ohi, n, keep_at, drop_at);
}

std::tuple<at::Tensor, at::Tensor> min_p_cut(const at::Tensor& lo_in, const at::Tensor& hi_in,
                                             const at::Tensor& keep_in, const at::Tensor& drop_in) {
  TORCH_CHECK(lo_in.dim() == 2 && lo_in.scalar_type() == at::kFloat && lo_in.device().is_cpu() &&
                  hi_in.sizes() == lo_in.sizes() && hi_in.scalar_type() == at::kFloat && hi_in.device().is_cpu(),
              "min_p_cut: lo, hi [R, n] float32 on the CPU");
  const int64_t R = lo_in.size(0), n = lo_in.size(1);
  TORCH_CHECK(keep_in.dim() == 1 && keep_in.size(0) == R && keep_in.scalar_type() == at::kFloat &&
                  drop_in.dim() == 1 && drop_in.size(0) == R && drop_in.scalar_type() == at::kFloat &&
                  keep_in.device().is_cpu() && drop_in.device().is_cpu(),
              "min_p_cut: keep_at, drop_at [R] float32 on the CPU");
  at::Tensor lo = lo_in.contiguous(), hi = hi_in.contiguous();
  at::Tensor keep = keep_in.contiguous(), drop = drop_in.contiguous();
  at::Tensor olo = at::empty_like(lo), ohi = at::empty_like(hi);
  const float *lp = lo.data_ptr<float>(), *hp = hi.data_ptr<float>();
  const float *kp = keep.data_ptr<float>(), *dp = drop.data_ptr<float>();
  float *olp = olo.data_ptr<float>(), *ohp = ohi.data_ptr<float>();
  static const auto fn = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")
                             ? cut_row_avx512
                             : (__builtin_cpu_supports("avx2") ? cut_row_avx2 : cut_row_any);
  constexpr int64_t CH = 8192;  // tokens a task: rows split so that 2+ threads share a few rows
  const int64_t per_row = (n + CH - 1) / CH;
  at::parallel_for(0, R * per_row, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / per_row, c0 = (t % per_row) * CH, m = std::min(CH, n - c0);
      const int64_t off = r * n + c0;
      fn(lp + off, hp + off, olp + off, ohp + off, m, kp[r], dp[r]);
    }
  });
  return {olo, ohi};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_csv_cpu, m) {
  m.def("min_p_cut(Tensor lo, Tensor hi, Tensor keep_at, Tensor drop_at) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(vllm_csv_cpu, CPU, m) { m.impl("min_p_cut", &min_p_cut); }
