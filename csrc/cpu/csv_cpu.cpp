// CPU kernels of the certified step after the candidate search: the exact scores of the
// candidates and the top-k certificate, fused.
//
// * score_intervals: the float64 dot products of the candidates and their fp32 intervals;
// * certify_topk: the top-k certificate of a plain engine;
// * finish_selection: the [B, V] output of the certified rows and each row's outcome.
//
// Why: on a CPU the screen GEMM streams the whole int8 head (50-150 MB) through the caches,
// evicting the code of every small torch op that follows; each distinct op then costs
// 30-200 us cold instead of 2-10 us warm. The certified step's torch reference runs about
// 60 distinct small ops: 1-2 ms a step, as much as half the GEMM at V = 65536. These kernels,
// the per-row passes before them (rows_cpu.cpp: vllm_csv/ops/rows.py) and the candidate search
// (select_cpu.cpp: vllm_csv/ops/select.py) compute the same numbers in a few calls. This source
// also holds the library's definition (TORCH_LIBRARY below; the others add fragments).
//
// Each op has its torch reference in vllm_csv/ops/step.py with the same signature, and
// the proof of its bounds there; the arithmetic here follows the reference operation by
// operation (fp32 where it is fp32, with scalars rounded to fp32 as torch rounds them), so
// that the outputs match bit for bit, except where the reference sums in float64 in torch's
// order (dot products): there the bound holds for any order, and the two may differ
// in the last bits. Built with -ffp-contract=off: no fused multiply-adds the reference lacks
// (score_intervals' explicit ones multiply numbers whose product is exact: see dots_avx512).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "fp32.h"
#include "isa.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using namespace csv_fp32;

// ---- score_intervals ------------------------------------------------------------------------
// The float64 dot products <h_b, w> and <|h_b|, |w|> of one row w (d values, already in float64)
// with every row b: AVX-512 where the CPU has it (eight lanes, four accumulators of each: the
// bound holds for any order of summation, and each product of two model-dtype numbers is exact
// in float64, so a fused multiply-add rounds exactly as the add alone), else ACC scalar chains.
constexpr int ACC = 8;
constexpr int64_t PREFETCH = 4;  // score_intervals: rows fetched ahead

void dots_scalar(const double* wd, const double* hd, const double* ha, int64_t B, int64_t d,
                 double* a_out, double* A_out) {
  for (int64_t b = 0; b < B; ++b) {
    double as[ACC] = {0}, As[ACC] = {0};
    const double* hb = hd + b * d;
    const double* hab = ha + b * d;
    int64_t j = 0;
    for (; j + ACC <= d; j += ACC)
      for (int q = 0; q < ACC; ++q) {
        as[q] += hb[j + q] * wd[j + q];  // products of model-dtype numbers: exact in float64
        As[q] += hab[j + q] * std::fabs(wd[j + q]);
      }
    for (; j < d; ++j) {
      as[0] += hb[j] * wd[j];
      As[0] += hab[j] * std::fabs(wd[j]);
    }
    double a = 0.0, A = 0.0;
    for (int q = 0; q < ACC; ++q) {
      a += as[q];
      A += As[q];
    }
    a_out[b] = a;
    A_out[b] = A;
  }
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) void dots_avx512(const double* wd, const double* hd, const double* ha,
                                                     int64_t B, int64_t d, double* a_out, double* A_out) {
  for (int64_t b = 0; b < B; ++b) {
    const double* hb = hd + b * d;
    const double* hab = ha + b * d;
    __m512d as[4], As[4];
    for (int q = 0; q < 4; ++q) as[q] = As[q] = _mm512_setzero_pd();
    int64_t j = 0;
    for (; j + 32 <= d; j += 32)
      for (int q = 0; q < 4; ++q) {
        const __m512d w = _mm512_loadu_pd(wd + j + 8 * q);
        as[q] = _mm512_fmadd_pd(_mm512_loadu_pd(hb + j + 8 * q), w, as[q]);
        As[q] = _mm512_fmadd_pd(_mm512_loadu_pd(hab + j + 8 * q), _mm512_abs_pd(w), As[q]);
      }
    for (; j + 8 <= d; j += 8) {
      const __m512d w = _mm512_loadu_pd(wd + j);
      as[0] = _mm512_fmadd_pd(_mm512_loadu_pd(hb + j), w, as[0]);
      As[0] = _mm512_fmadd_pd(_mm512_loadu_pd(hab + j), _mm512_abs_pd(w), As[0]);
    }
    double a = _mm512_reduce_add_pd(_mm512_add_pd(_mm512_add_pd(as[0], as[1]), _mm512_add_pd(as[2], as[3])));
    double A = _mm512_reduce_add_pd(_mm512_add_pd(_mm512_add_pd(As[0], As[1]), _mm512_add_pd(As[2], As[3])));
    for (; j < d; ++j) {
      a += hb[j] * wd[j];
      A += hab[j] * std::fabs(wd[j]);
    }
    a_out[b] = a;
    A_out[b] = A;
  }
}

// The first values of one row of the head in float64 (bf16 / fp16 widened exactly, sixteen at a
// time); returns how many (a multiple of 16: the caller widens the rest with at64).
__attribute__((target("avx512f"))) int64_t widen_avx512(const uint16_t* w, bool bf16, int64_t d, double* out) {
  int64_t j = 0;
  for (; j + 16 <= d; j += 16) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j));
    const __m512 f = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16)) : _mm512_cvtph_ps(x);
    _mm512_storeu_pd(out + j, _mm512_cvtps_pd(_mm512_castps512_ps256(f)));
    _mm512_storeu_pd(out + j + 8, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1))));
  }
  return j;
}

bool has_avx512f() {
  static const bool yes = CSV_CPU_SUPPORTS("avx512f");
  return yes;
}
#endif

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> score_intervals(
    const at::Tensor& h_in, const at::Tensor& w_in, const at::Tensor& ids_in, double coef, double tiny32) {
  TORCH_CHECK(h_in.dim() == 2 && w_in.dim() == 2 && h_in.size(1) == w_in.size(1) && h_in.device().is_cpu(),
              "score_intervals: h [B, d] and w [V, d] on the CPU");
  TORCH_CHECK(h_in.scalar_type() == w_in.scalar_type(), "score_intervals: h and w of one dtype");
  at::Tensor h = h_in.contiguous(), w = w_in.contiguous();
  at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t B = h.size(0), d = h.size(1), S = ids.size(0), V = w.size(0);
  const int64_t* ip = ids.data_ptr<int64_t>();
  at::Tensor a_t = at::empty({B, S}, h.options().dtype(at::kDouble));
  at::Tensor E_t = at::empty({B, S}, h.options().dtype(at::kDouble));
  double* Ep = E_t.data_ptr<double>();
  at::Tensor lo_t = at::empty({B, S}, h.options().dtype(at::kFloat));
  at::Tensor hi_t = at::empty({B, S}, h.options().dtype(at::kFloat));
  at::Tensor lower_t = at::empty({B, S}, h.options().dtype(at::kFloat));
  at::Tensor upper_t = at::empty({B, S}, h.options().dtype(at::kFloat));
  at::Tensor z_t = at::empty({B, S}, h.options());
  double* ap = a_t.data_ptr<double>();
  float* lo = lo_t.data_ptr<float>();
  float* hi = hi_t.data_ptr<float>();
  float* lw = lower_t.data_ptr<float>();
  float* up = upper_t.data_ptr<float>();
  const double eps52 = std::ldexp(1.0, -52);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "score_intervals", [&] {
    const scalar_t* hp = h.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* zp = z_t.data_ptr<scalar_t>();
    std::vector<double> hd(B * d), ha(B * d);
    for (int64_t q = 0; q < B * d; ++q) {
      hd[q] = at64(hp, q);
      ha[q] = std::fabs(hd[q]);
    }
    for (int64_t s = 0; s < S; ++s)
      TORCH_CHECK(ip[s] >= 0 && ip[s] < V, "score_intervals: id out of range");
    // Tokens split over the threads; each token's sums on independent accumulators (dots_*):
    // the bound (coef's 4 gamma64_d of A) holds for any order of summation, and one dependent
    // chain of d additions was the kernel's cost (about 3.5 us a token at d = 768, one thread:
    // more than the int4 screen's GEMM on a few hundred candidates).
    at::parallel_for(0, S, 16, [&](int64_t s0, int64_t s1) {
    std::vector<double> wd(d), av(B), Av(B);
    // The rows are scattered over a head the screen's GEMM has just pushed out of the caches:
    // each is fetched PREFETCH tokens ahead of its sums (the step waits on memory).
    const int64_t row_bytes = d * static_cast<int64_t>(sizeof(scalar_t));
    auto prefetch_row = [&](int64_t s) {
      const char* row = reinterpret_cast<const char*>(wp + ip[s] * d);
      for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(row + off);
    };
    for (int64_t s = s0; s < std::min(s1, s0 + PREFETCH); ++s) prefetch_row(s);
    for (int64_t s = s0; s < s1; ++s) {
      const scalar_t* wr = wp + ip[s] * d;
      if (s + PREFETCH < s1) prefetch_row(s + PREFETCH);
      int64_t j = 0;
#if defined(__x86_64__)
      constexpr bool half16 = std::is_same_v<scalar_t, at::BFloat16> || std::is_same_v<scalar_t, at::Half>;
      if (half16 && has_avx512f())
        j = widen_avx512(reinterpret_cast<const uint16_t*>(wr), std::is_same_v<scalar_t, at::BFloat16>, d, wd.data());
#endif
      for (; j < d; ++j) wd[j] = at64(wr, j);
#if defined(__x86_64__)
      if (has_avx512f())
        dots_avx512(wd.data(), hd.data(), ha.data(), B, d, av.data(), Av.data());
      else
#endif
        dots_scalar(wd.data(), hd.data(), ha.data(), B, d, av.data(), Av.data());
      for (int64_t b = 0; b < B; ++b) {
        const double a = av[b], A = Av[b];
        double E = A * coef;
        E = E + tiny32;
        E = E + std::fabs(a) * eps52;
        ap[b * S + s] = a;
        Ep[b * S + s] = E;
        const int64_t o = b * S + s;
        lo[o] = round_down32(a - E);
        hi[o] = round_up32(a + E);
        // Without a bias: the engine's rounding of each end (monotone), and z, the value
        // itself where both ends agree bit for bit, else a rounded to fp32, then to the dtype.
        lw[o] = static_cast<float>(static_cast<scalar_t>(lo[o]));
        up[o] = static_cast<float>(static_cast<scalar_t>(hi[o]));
        const bool known = lw[o] == up[o] && std::signbit(lw[o]) == std::signbit(up[o]);
        zp[o] = known ? static_cast<scalar_t>(lw[o]) : static_cast<scalar_t>(static_cast<float>(a));
      }
    }
    });
  });
  return {a_t, E_t, lo_t, hi_t, lower_t, upper_t, z_t};
}

// ---- certify_topk ---------------------------------------------------------------------------
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

std::tuple<at::Tensor, at::Tensor> certify_topk(const at::Tensor& z_in, const at::Tensor& lower_in,
                                                const at::Tensor& upper_in, const at::Tensor& k_in,
                                                const at::Tensor& oh_in, const at::Tensor& need_in) {
  TORCH_CHECK(z_in.dim() == 2 && z_in.device().is_cpu(), "certify_topk: z [B, S] on the CPU");
  at::Tensor z = z_in.contiguous();
  at::Tensor lower = lower_in.to(at::kFloat).contiguous(), upper = upper_in.to(at::kFloat).contiguous();
  at::Tensor kt = k_in.to(at::kLong).contiguous(), oh = oh_in.to(at::kFloat).contiguous();
  at::Tensor need = need_in.to(at::kBool).contiguous();
  const int64_t B = z.size(0), S = z.size(1);
  at::Tensor ok_t = at::empty({B}, need.options());
  at::Tensor top_t = at::zeros({B, S}, need.options());
  bool* okp = ok_t.data_ptr<bool>();
  bool* tp = top_t.data_ptr<bool>();
  const float* lw = lower.data_ptr<float>();
  const float* up = upper.data_ptr<float>();
  const int64_t* kp = kt.data_ptr<int64_t>();
  const float* ohp = oh.data_ptr<float>();
  const bool* np = need.data_ptr<bool>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, z.scalar_type(), "certify_topk", [&] {
    const scalar_t* zp = z.data_ptr<scalar_t>();
    std::vector<int64_t> order(S);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t k = kp[b];
      TORCH_CHECK(1 <= k && k <= S, "certify_topk: 1 <= k <= S");
      const scalar_t* zr = zp + b * S;
      for (int64_t s = 0; s < S; ++s) order[s] = s;
      // T: k columns of largest z (ties broken by the lower index; any choice is sound, and
      // a tie across T's edge is never certified: the tied values bound each other)
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t i, int64_t j) {
        const float a = static_cast<float>(zr[i]), c = static_cast<float>(zr[j]);
        return a > c || (a == c && i < j);
      });
      bool* tr = tp + b * S;
      for (int64_t q = 0; q < k; ++q) tr[order[q]] = true;
      float low = INF32, high = -INF32;
      bool all_known = true;
      for (int64_t s = 0; s < S; ++s) {
        const float l = lw[b * S + s], u = up[b * S + s];
        if (tr[s]) {
          low = (l < low || l != l) ? l : low;  // NaN propagates (torch amin)
          all_known &= l == u && std::signbit(l) == std::signbit(u);
        } else {
          high = (u > high || u != u) ? u : high;
        }
      }
      float hh = ohp[b];
      hh = (high != high || hh != hh) ? NAN32 : std::max(high, hh);
      hh = round_to<scalar_t>(hh);  // the engine's rounding of any value below it (monotone)
      okp[b] = low > hh && std::isfinite(low) && (all_known || !np[b]);
    }
  });
  return {ok_t, top_t};
}

// ---- finish_selection ---------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor> finish_selection(int64_t V, const at::Tensor& ids_in, const at::Tensor& z_in,
                                                    const at::Tensor& top_in, const at::Tensor& ok_in,
                                                    const at::Tensor& live_in, const at::Tensor& cert_in) {
  at::Tensor ids = ids_in.to(at::kLong).contiguous(), z = z_in.contiguous();
  at::Tensor top = top_in.to(at::kBool).contiguous(), ok = ok_in.to(at::kBool).contiguous();
  at::Tensor live = live_in.to(at::kBool).contiguous(), cert = cert_in.to(at::kBool).contiguous();
  const int64_t B = ok.size(0), S = ids.size(0);
  TORCH_CHECK(z.dim() == 2 && z.size(0) == B && z.size(1) == S && top.sizes() == z.sizes(),
              "finish_selection: z and in_top [B, S]");
  at::Tensor exact = at::full({B, V}, -std::numeric_limits<double>::infinity(), z.options());
  at::Tensor code = at::empty({B}, ids.options());
  const int64_t* ip = ids.data_ptr<int64_t>();
  const bool* tp = top.data_ptr<bool>();
  const bool *okp = ok.data_ptr<bool>(), *lp = live.data_ptr<bool>(), *cp = cert.data_ptr<bool>();
  int64_t* codep = code.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, z.scalar_type(), "finish_selection", [&] {
    const scalar_t* zp = z.data_ptr<scalar_t>();
    scalar_t* ep = exact.data_ptr<scalar_t>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s)
        if (tp[b * S + s]) ep[b * V + ip[s]] = zp[b * S + s];
  });
  for (int64_t b = 0; b < B; ++b)
    codep[b] = (okp[b] && lp[b] && cp[b]) ? 0 : !okp[b] ? 1 : !lp[b] ? 2 : 3;
  return {exact, code};
}
}  // namespace

// The cap VLLM_CSV_CPU_ISA put on the kernels' dispatch when the library loaded (isa.h):
// 1 avx2, 2 avx512, 3 auto.
int64_t cpu_isa_cap() { return csv_isa::loaded; }

TORCH_LIBRARY(vllm_csv_cpu, m) {  // the library; every other source adds its ops as a fragment
  m.def("cpu_isa_cap() -> int");
  m.def(
      "certify_topk(Tensor z, Tensor lower, Tensor upper, Tensor k, Tensor outside_high, Tensor need_values) "
      "-> (Tensor, Tensor)");
  m.def(
      "finish_selection(int V, Tensor ids, Tensor z, Tensor in_top, Tensor ok, Tensor live, Tensor cert) "
      "-> (Tensor, Tensor)");
  m.def("score_intervals(Tensor h, Tensor w, Tensor ids, float coef, float tiny32) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(vllm_csv_cpu, CPU, m) {
  m.impl("score_intervals", &score_intervals);
  m.impl("certify_topk", &certify_topk);
  m.impl("finish_selection", &finish_selection);
}

TORCH_LIBRARY_IMPL(vllm_csv_cpu, CompositeExplicitAutograd, m) { m.impl("cpu_isa_cap", &cpu_isa_cap); }
