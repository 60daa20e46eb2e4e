// vLLM's min-p and top-k masks on bounds, one pass each (vllm_csv/sampling/nucleus.py: min_p_bounds,
// top_k_bounds; the torch references are vllm_csv.ops.masks.min_p_cut_ref and top_k_cut_ref).
//
// For each row r and column c of lo, hi ([R, n] float32), with the row's thresholds keep_at[r],
// drop_at[r] (float32; NaN: never):
//   new_lo = lo >= keep_at ? lo : -inf                  (certainly kept: its lower bound stays)
//   new_hi = (hi < drop_at && lo > -inf) ? -inf : hi    (certainly dropped)
// top_k_cut, with the row's levels hk = H_k, hk1 = H_(k+1) (of the upper bounds) and lk = L_k:
//   new_lo = lo >= (hi >= hk ? hk1 : hk) ? lo : -inf      (certainly kept)
//   new_hi = hi < lk ? -inf : hi                          (certainly dropped)
// Comparisons only: the cuts' outputs are the reference's bit for bit. Why a kernel: torch's where and
// masked_fill on this build run a scalar loop over bool masks (about 0.7 ms each for 8 rows of
// 65536 tokens on 2 cores, where one vectorised pass takes 30 us).
//
// top_p_sums (vllm_csv/sampling/nucleus.py: TopPQueries.bounds; the torch reference is
// vllm_csv.ops.masks.top_p_sums_ref): for query q, the token i = qcol[q] of row r = qrow[q] of
// lo, hi ([R, n] float32), with a = lo[r, i], b = hi[r, i] and the row's masses el, eh ([R, n]
// float64), the four sums over the row's tokens j
//   n_hi = sum_{j != i, hi_j >= a} eh_j    r_lo = sum_{hi_j < a} el_j
//   n_lo = sum_{lo_j > b} el_j              r_hi = sum_{lo_j <= b} eh_j
// (i is in none but r_hi while a <= b: the caller adds its own lower mass to r_lo)
// into out[q, 0..3] (float64). The order of each float64 sum of nonnegative terms is not the
// reference's (within gamma_n of it, as any order is). Why a kernel: the reference reads a
// [Q, n] mask and product per sum; one query's pass over a row of 65536 tokens takes ~20 us here.
//
// unlisted_masses (vllm_csv/sampling/nucleus.py: TopPQueries._unlisted; the torch reference is
// vllm_csv.ops.masks.unlisted_masses_ref): for row r of lo, hi ([R, n] float32) with its shift c[r]
// (float32) and its listed tokens ih[r] ([R, K] int64), out[r] = (sum of fl(exp(fl(lo_j - c))),
// the same of hi_j) over the tokens j not listed, in float64 (any order: within gamma_n of the
// reference's). exp is SLEEF's expf16_u10 (at most 1 ulp; the function torch's own exp runs on
// AVX-512 CPUs), from libtorch: no AVX-512 or no such symbol, and the op refuses (the caller
// takes the reference). Why a kernel: the reference makes four passes over [R, n] (subtract, exp,
// and a float64 copy of the row before its sum), about 1.9 ms a side for 32 rows of 65536 tokens
// on 2 cores, and top-p's rounds take both sides of each row several times a step.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "isa.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <tuple>
#include <vector>

// SLEEF's vectorised expf, as libtorch exports it (weak: a libtorch without it leaves it null).
extern "C" __m512 Sleef_expf16_u10(__m512) __attribute__((weak));

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

template <int DUMMY>
inline void top_k_row(const float* lo, const float* hi, float* olo, float* ohi, int64_t n, float hk, float hk1,
                      float lk) {
  const float ninf = -std::numeric_limits<float>::infinity();
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float a = lo[j], b = hi[j];
    olo[j] = a >= (b >= hk ? hk1 : hk) ? a : ninf;
    ohi[j] = b < lk ? ninf : b;
  }
}

__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl"))) void top_k_row_avx512(const float* lo, const float* hi,
                                                                                     float* olo, float* ohi, int64_t n,
                                                                                     float hk, float hk1, float lk) {
  top_k_row<0>(lo, hi, olo, ohi, n, hk, hk1, lk);
}

__attribute__((target("avx2"))) void top_k_row_avx2(const float* lo, const float* hi, float* olo, float* ohi,
                                                    int64_t n, float hk, float hk1, float lk) {
  top_k_row<1>(lo, hi, olo, ohi, n, hk, hk1, lk);
}

void top_k_row_any(const float* lo, const float* hi, float* olo, float* ohi, int64_t n, float hk, float hk1,
                   float lk) {
  top_k_row<2>(lo, hi, olo, ohi, n, hk, hk1, lk);
}

// Both cuts' argument checks.
void check_cut(const char* name, const char* level_names, const at::Tensor& lo, const at::Tensor& hi,
               std::initializer_list<const at::Tensor*> levels) {
  TORCH_CHECK(lo.dim() == 2 && lo.scalar_type() == at::kFloat && lo.device().is_cpu() && hi.sizes() == lo.sizes() &&
                  hi.scalar_type() == at::kFloat && hi.device().is_cpu(),
              name, ": lo, hi [R, n] float32 on the CPU");
  for (const at::Tensor* t : levels)
    TORCH_CHECK(t->dim() == 1 && t->size(0) == lo.size(0) && t->scalar_type() == at::kFloat && t->device().is_cpu(),
                name, ": ", level_names, " [R] float32 on the CPU");
}

// Both cuts: each row's chunks in parallel, cut(r, lo, hi, out_lo, out_hi, length) on each.
template <typename Cut>
std::tuple<at::Tensor, at::Tensor> cut_rows(const at::Tensor& lo_in, const at::Tensor& hi_in, Cut cut) {
  const int64_t R = lo_in.size(0), n = lo_in.size(1);
  at::Tensor lo = lo_in.contiguous(), hi = hi_in.contiguous();
  at::Tensor olo = at::empty_like(lo), ohi = at::empty_like(hi);
  const float *lp = lo.data_ptr<float>(), *hp = hi.data_ptr<float>();
  float *olp = olo.data_ptr<float>(), *ohp = ohi.data_ptr<float>();
  constexpr int64_t CH = 8192;  // tokens a task: rows split so that 2+ threads share a few rows
  const int64_t per_row = (n + CH - 1) / CH;
  at::parallel_for(0, R * per_row, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / per_row, c0 = (t % per_row) * CH, m = std::min(CH, n - c0);
      const int64_t off = r * n + c0;
      cut(r, lp + off, hp + off, olp + off, ohp + off, m);
    }
  });
  return {olo, ohi};
}

std::tuple<at::Tensor, at::Tensor> min_p_cut(const at::Tensor& lo, const at::Tensor& hi, const at::Tensor& keep_in,
                                             const at::Tensor& drop_in) {
  static const auto fn = CSV_CPU_SUPPORTS("avx512bw") && CSV_CPU_SUPPORTS("avx512vl")
                             ? cut_row_avx512
                             : (CSV_CPU_SUPPORTS("avx2") ? cut_row_avx2 : cut_row_any);
  check_cut("min_p_cut", "keep_at, drop_at", lo, hi, {&keep_in, &drop_in});
  const at::Tensor keep = keep_in.contiguous(), drop = drop_in.contiguous();
  const float *kp = keep.data_ptr<float>(), *dp = drop.data_ptr<float>();
  return cut_rows(lo, hi,
                  [&](int64_t r, const float* l, const float* h, float* ol, float* oh, int64_t m) {
                    fn(l, h, ol, oh, m, kp[r], dp[r]);
                  });
}

std::tuple<at::Tensor, at::Tensor> top_k_cut(const at::Tensor& lo, const at::Tensor& hi, const at::Tensor& hk_in,
                                             const at::Tensor& hk1_in, const at::Tensor& lk_in) {
  static const auto fn = CSV_CPU_SUPPORTS("avx512bw") && CSV_CPU_SUPPORTS("avx512vl")
                             ? top_k_row_avx512
                             : (CSV_CPU_SUPPORTS("avx2") ? top_k_row_avx2 : top_k_row_any);
  check_cut("top_k_cut", "hk, hk1, lk", lo, hi, {&hk_in, &hk1_in, &lk_in});
  const at::Tensor hk = hk_in.contiguous(), hk1 = hk1_in.contiguous(), lk = lk_in.contiguous();
  const float *a = hk.data_ptr<float>(), *b = hk1.data_ptr<float>(), *c = lk.data_ptr<float>();
  return cut_rows(lo, hi,
                  [&](int64_t r, const float* l, const float* h, float* ol, float* oh, int64_t m) {
                    fn(l, h, ol, oh, m, a[r], b[r], c[r]);
                  });
}

// (always_inline: called twice, it was otherwise compiled once for the base ISA, 10x slower)
template <int DUMMY>
__attribute__((always_inline)) inline void top_p_range(const float* lo, const float* hi, const double* el,
                                                       const double* eh, int64_t j0, int64_t j1, float a, float b,
                                                       double* acc) {
  double nh = 0, rl = 0, nl = 0, rh = 0;
#pragma omp simd reduction(+ : nh, rl, nl, rh)
  for (int64_t j = j0; j < j1; ++j) {
    const bool up = hi[j] >= a, after = lo[j] > b;
    nh += up ? eh[j] : 0.0;
    rl += up ? 0.0 : el[j];
    nl += after ? el[j] : 0.0;
    rh += after ? 0.0 : eh[j];
  }
  acc[0] += nh;
  acc[1] += rl;
  acc[2] += nl;
  acc[3] += rh;
}

template <int DUMMY>
__attribute__((always_inline)) inline void top_p_query(const float* lo, const float* hi, const double* el,
                                                       const double* eh, int64_t n, int64_t i, double* out) {
  const float a = lo[i], b = hi[i];
  double acc[4] = {0, 0, 0, 0};
  top_p_range<DUMMY>(lo, hi, el, eh, 0, i, a, b, acc);
  top_p_range<DUMMY>(lo, hi, el, eh, i + 1, n, a, b, acc);
  out[0] = acc[0];  // (i itself out of n_hi)
  out[1] = acc[1] + (hi[i] >= a ? 0.0 : el[i]);
  out[2] = acc[2] + (lo[i] > b ? el[i] : 0.0);
  out[3] = acc[3] + (lo[i] > b ? 0.0 : eh[i]);
}

__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl"))) void top_p_query_avx512(
    const float* lo, const float* hi, const double* el, const double* eh, int64_t n, int64_t i, double* out) {
  top_p_query<0>(lo, hi, el, eh, n, i, out);
}

__attribute__((target("avx2"))) void top_p_query_avx2(const float* lo, const float* hi, const double* el,
                                                      const double* eh, int64_t n, int64_t i, double* out) {
  top_p_query<1>(lo, hi, el, eh, n, i, out);
}

void top_p_query_any(const float* lo, const float* hi, const double* el, const double* eh, int64_t n, int64_t i,
                     double* out) {
  top_p_query<2>(lo, hi, el, eh, n, i, out);
}

at::Tensor top_p_sums(const at::Tensor& lo_in, const at::Tensor& hi_in, const at::Tensor& el_in,
                      const at::Tensor& eh_in, const at::Tensor& qrow_in, const at::Tensor& qcol_in) {
  static const auto fn = CSV_CPU_SUPPORTS("avx512bw") && CSV_CPU_SUPPORTS("avx512vl")
                             ? top_p_query_avx512
                             : (CSV_CPU_SUPPORTS("avx2") ? top_p_query_avx2 : top_p_query_any);
  check_cut("top_p_sums", "", lo_in, hi_in, {});
  TORCH_CHECK(el_in.sizes() == lo_in.sizes() && eh_in.sizes() == lo_in.sizes() &&
                  el_in.scalar_type() == at::kDouble && eh_in.scalar_type() == at::kDouble && el_in.device().is_cpu() &&
                  eh_in.device().is_cpu(),
              "top_p_sums: el, eh [R, n] float64 on the CPU");
  TORCH_CHECK(qrow_in.dim() == 1 && qcol_in.sizes() == qrow_in.sizes() && qrow_in.scalar_type() == at::kLong &&
                  qcol_in.scalar_type() == at::kLong && qrow_in.device().is_cpu() && qcol_in.device().is_cpu(),
              "top_p_sums: qrow, qcol [Q] int64 on the CPU");
  const int64_t R = lo_in.size(0), n = lo_in.size(1), Q = qrow_in.size(0);
  const at::Tensor lo = lo_in.contiguous(), hi = hi_in.contiguous(), el = el_in.contiguous(), eh = eh_in.contiguous();
  const at::Tensor qrow = qrow_in.contiguous(), qcol = qcol_in.contiguous();
  const int64_t *qr = qrow.data_ptr<int64_t>(), *qc = qcol.data_ptr<int64_t>();
  for (int64_t q = 0; q < Q; ++q)
    TORCH_CHECK(qr[q] >= 0 && qr[q] < R && qc[q] >= 0 && qc[q] < n, "top_p_sums: query ", q, " (row ", qr[q],
                ", column ", qc[q], ") is outside [", R, ", ", n, "]");
  at::Tensor out = at::empty({Q, 4}, lo.options().dtype(at::kDouble));
  const float *lp = lo.data_ptr<float>(), *hp = hi.data_ptr<float>();
  const double *elp = el.data_ptr<double>(), *ehp = eh.data_ptr<double>();
  double* op = out.data_ptr<double>();
  at::parallel_for(0, Q, 1, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t off = qr[q] * n;
      fn(lp + off, hp + off, elp + off, ehp + off, n, qc[q], op + 4 * q);
    }
  });
  return out;
}

bool unlisted_masses_supported() {
  static const bool ok = Sleef_expf16_u10 != nullptr && CSV_CPU_SUPPORTS("avx512f") &&
                         CSV_CPU_SUPPORTS("avx512bw") && CSV_CPU_SUPPORTS("avx512vl") &&
                         CSV_CPU_SUPPORTS("avx512dq");
  return ok;
}

// One row: out[0] = sum over unlisted j of exp(lo_j - c), out[1] the same of hi (keep[j] != 0:
// not listed). Lanes past n load 0 and are dropped after the exp (exp(-c) may be inf there).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void unlisted_row(
    const float* lo, const float* hi, const uint8_t* keep, int64_t n, float c, double* out) {
  const __m512 cv = _mm512_set1_ps(c);
  __m512d al0 = _mm512_setzero_pd(), al1 = _mm512_setzero_pd(), ah0 = _mm512_setzero_pd(),
          ah1 = _mm512_setzero_pd();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 in = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
    const __mmask16 k = _mm_mask_test_epi8_mask(in, _mm_maskz_loadu_epi8(in, keep + j), _mm_set1_epi8(-1));
    const __m512 el = _mm512_maskz_mov_ps(k, Sleef_expf16_u10(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, lo + j), cv)));
    const __m512 eh = _mm512_maskz_mov_ps(k, Sleef_expf16_u10(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, hi + j), cv)));
    al0 = _mm512_add_pd(al0, _mm512_cvtps_pd(_mm512_castps512_ps256(el)));
    al1 = _mm512_add_pd(al1, _mm512_cvtps_pd(_mm512_extractf32x8_ps(el, 1)));
    ah0 = _mm512_add_pd(ah0, _mm512_cvtps_pd(_mm512_castps512_ps256(eh)));
    ah1 = _mm512_add_pd(ah1, _mm512_cvtps_pd(_mm512_extractf32x8_ps(eh, 1)));
  }
  out[0] = _mm512_reduce_add_pd(_mm512_add_pd(al0, al1));
  out[1] = _mm512_reduce_add_pd(_mm512_add_pd(ah0, ah1));
}

at::Tensor unlisted_masses(const at::Tensor& lo_in, const at::Tensor& hi_in, const at::Tensor& c_in,
                           const at::Tensor& ih_in) {
  TORCH_CHECK(unlisted_masses_supported(), "unlisted_masses needs AVX-512 and libtorch's Sleef_expf16_u10");
  check_cut("unlisted_masses", "", lo_in, hi_in, {});
  const int64_t R = lo_in.size(0), n = lo_in.size(1);
  TORCH_CHECK(c_in.numel() == R && c_in.scalar_type() == at::kFloat && c_in.device().is_cpu(),
              "unlisted_masses: c [R] (or [R, 1]) float32 on the CPU");
  TORCH_CHECK(ih_in.dim() == 2 && ih_in.size(0) == R && ih_in.scalar_type() == at::kLong && ih_in.device().is_cpu(),
              "unlisted_masses: ih [R, K] int64 on the CPU");
  const at::Tensor lo = lo_in.contiguous(), hi = hi_in.contiguous(), c = c_in.contiguous(), ih = ih_in.contiguous();
  const int64_t K = ih.size(1);
  const int64_t* ip = ih.data_ptr<int64_t>();
  for (int64_t i = 0; i < R * K; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < n, "unlisted_masses: listed token ", ip[i], " is outside [0, ", n, ")");
  at::Tensor out = at::empty({R, 2}, lo.options().dtype(at::kDouble));
  const float *lp = lo.data_ptr<float>(), *hp = hi.data_ptr<float>(), *cp = c.data_ptr<float>();
  double* op = out.data_ptr<double>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<uint8_t> keep(n, 1);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t k = 0; k < K; ++k) keep[ip[r * K + k]] = 0;
      unlisted_row(lp + r * n, hp + r * n, keep.data(), n, cp[r], op + 2 * r);
      for (int64_t k = 0; k < K; ++k) keep[ip[r * K + k]] = 1;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_csv_cpu, m) {
  m.def("unlisted_masses_supported() -> bool");
  m.def("unlisted_masses(Tensor lo, Tensor hi, Tensor c, Tensor ih) -> Tensor");
  m.def("min_p_cut(Tensor lo, Tensor hi, Tensor keep_at, Tensor drop_at) -> (Tensor, Tensor)");
  m.def("top_k_cut(Tensor lo, Tensor hi, Tensor hk, Tensor hk1, Tensor lk) -> (Tensor, Tensor)");
  m.def("top_p_sums(Tensor lo, Tensor hi, Tensor el, Tensor eh, Tensor qrow, Tensor qcol) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_csv_cpu, CPU, m) {
  m.impl("min_p_cut", &min_p_cut);
  m.impl("top_k_cut", &top_k_cut);
  m.impl("top_p_sums", &top_p_sums);
  m.impl("unlisted_masses", &unlisted_masses);
}

TORCH_LIBRARY_IMPL(vllm_csv_cpu, CompositeExplicitAutograd, m) {
  m.impl("unlisted_masses_supported", &unlisted_masses_supported);
}
