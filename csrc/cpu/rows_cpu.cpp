// CPU kernels of the certified step's per-row passes: each reads the rows of one tensor (the
// hidden states h [B, d] or the screen's values y [B, V]) once and writes what the step needs of
// them, where the torch reference takes several ops a row.
//
// * prepare_rows: ||h_b|| rounded up, and which rows may be certified;
// * outlier_rows: the int8 screen's outlier-channel test;
// * quantize_act7: the FBGEMM screen's 7-bit activations, their error and the folded scale;
// * abs_max_rows: max |y| of each row;
// * interval_rows: the screen's intervals around its centres.
//
// Why fused: the screen's GEMM streams the whole int8 head (50-150 MB) through the caches and
// evicts the code of every small torch op that follows (30-200 us cold instead of 2-10 warm).
// Each op has its torch reference in vllm_csv/ops/rows.py with the same signature, and the proof
// of its bounds there; the arithmetic here follows the reference operation by operation (fp32
// where it is fp32), so that the outputs match bit for bit, except where the reference sums in
// float64 in torch's order (norms): there the bound holds for any order, and the two may differ
// in the last bit. Built with -ffp-contract=off (interval_rows' multiply-adds are explicit, as
// torch's addcmul fuses them). The candidate search, the exact scores and the certificate that
// follow these passes are in select_cpu.cpp (vllm_csv/ops/select.py) and csv_cpu.cpp
// (vllm_csv/ops/step.py).

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

// The constants come from their one place in Python (vllm_csv/ops/build.py passes them).
constexpr int ACT_MIN = CSV_ACT_MIN, ACT_MAX = CSV_ACT_MAX;  // vllm_csv.ops.fbgemm
constexpr int K_MIN = CSV_K_MIN;  // vllm_csv.ops.build.K_MIN
constexpr int C_MIN_LOG2 = CSV_C_MIN_LOG2, C_MAX_LOG2 = CSV_C_MAX_LOG2;
const double S_MIN = std::ldexp(1.0, -126);

using namespace csv_fp32;  // round_up32, at64 (fp32.h)

// ---- prepare_rows -------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor, at::Tensor> prepare_rows(const at::Tensor& h_in, bool certifiable) {
  TORCH_CHECK(h_in.dim() == 2 && h_in.device().is_cpu(), "prepare_rows: h [B, d] on the CPU");
  at::Tensor h = h_in.contiguous();
  const int64_t B = h.size(0), d = h.size(1);
  at::Tensor hm = h.clone();
  at::Tensor hnorm = at::empty({B}, h.options().dtype(at::kFloat));
  at::Tensor ok = at::empty({B}, h.options().dtype(at::kBool));
  float* hn = hnorm.data_ptr<float>();
  bool* okp = ok.data_ptr<bool>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "prepare_rows", [&] {
    const scalar_t* src = h.data_ptr<scalar_t>();
    scalar_t* dst = hm.data_ptr<scalar_t>();
    for (int64_t b = 0; b < B; ++b) {
      double ss = 0.0;
      bool sub = false;  // an entry an engine that reads subnormals as zero would drop
      const scalar_t* row = src + b * d;
      for (int64_t j = 0; j < d; ++j) {
        const double v = at64(row, j);
        ss += v * v;
        sub |= v != 0.0 && std::fabs(v) < 1.1754943508222875e-38;
      }
      const float n32 = round_up32(std::sqrt(ss));
      const bool good = std::isfinite(n32) && certifiable && !sub;
      okp[b] = good;
      hn[b] = good ? n32 : 0.0f;
      if (!good) std::fill(dst + b * d, dst + (b + 1) * d, static_cast<scalar_t>(0));
    }
  });
  return {hm, hnorm, ok};
}

// ---- outlier_rows ---------------------------------------------------------------------
// [B] bool: the row's largest |h_bj| exceeds `ratio` times the rms of the row without its `m`
// largest |h| (vllm_csv.ops.rows.outlier_rows_ref; the int8 screen's outlier channels). One pass
// a row: float64 sum of squares and the m largest in a small sorted array. Rows with NaN/inf: false.
at::Tensor outlier_rows(const at::Tensor& h_in, double ratio, int64_t m) {
  TORCH_CHECK(h_in.dim() == 2 && h_in.device().is_cpu() && m >= 1 && m <= 64, "outlier_rows: h [B, d] on the CPU");
  at::Tensor h = h_in.contiguous();
  const int64_t B = h.size(0), d = h.size(1);
  at::Tensor out = at::zeros({B}, h.options().dtype(at::kBool));
  bool* op = out.data_ptr<bool>();
  if (d <= 2 * m) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "outlier_rows", [&] {
    const scalar_t* src = h.data_ptr<scalar_t>();
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      std::vector<double> top(m);
      for (int64_t b = b0; b < b1; ++b) {
        const scalar_t* row = src + b * d;
        std::fill(top.begin(), top.end(), 0.0);  // descending
        double ss = 0.0;
        bool finite = true;
        for (int64_t j = 0; j < d; ++j) {
          const double a = std::fabs(at64(row, j));
          finite &= std::isfinite(a);
          ss += a * a;
          if (a > top[m - 1]) {  // insert, keeping the m largest in order
            int64_t i = m - 1;
            while (i > 0 && top[i - 1] < a) {
              top[i] = top[i - 1];
              --i;
            }
            top[i] = a;
          }
        }
        double big = 0.0;
        for (int64_t i = 0; i < m; ++i) big += top[i] * top[i];
        const double rest = std::max(ss - big, 0.0) / static_cast<double>(d - m);
        op[b] = finite && top[0] > 0.0 && top[0] * top[0] > ratio * ratio * rest;
      }
    });
  });
  return out;
}

// ---- quantize_act7 --------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor, at::Tensor, double> quantize_act7(const at::Tensor& h_in, double s_min,
                                                                    double s_max) {
  TORCH_CHECK(h_in.dim() == 2 && h_in.device().is_cpu(), "quantize_act7: h [B, d] on the CPU");
  at::Tensor h = h_in.contiguous();
  const int64_t B = h.size(0), d = h.size(1);
  std::vector<int> kk(B, 0);
  std::vector<char> live(B, 0);
  std::vector<double> f(B, 0.0);
  at::Tensor x = at::empty({B, d + 2}, h.options().dtype(at::kFloat));
  float* xp = x.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "quantize_act7", [&] {
    const scalar_t* src = h.data_ptr<scalar_t>();
    for (int64_t b = 0; b < B; ++b) {
      const scalar_t* row = src + b * d;
      double a = 0.0;
      bool nan = false;
      for (int64_t j = 0; j < d; ++j) {
        const double v = std::fabs(at64(row, j));
        nan |= std::isnan(v);
        a = v > a ? v : a;
      }
      if (!nan && std::isfinite(a) && a > 0) {
        int e;
        const double m = std::frexp(a, &e);
        const int k = e - (m == 0.5 ? 1 : 0);
        if (k >= K_MIN) {
          kk[b] = k;
          live[b] = 1;
        }
      }
      const double scale = std::ldexp(1.0, kk[b] - 6);  // t_b / 64, exact
      double ss = 0.0;
      float* xr = xp + b * (d + 2);
      for (int64_t j = 0; j < d; ++j) {
        const double v = at64(row, j);
        double p = 0.0;
        if (live[b]) p = std::min<double>(std::max<double>(std::nearbyint(v / scale), ACT_MIN), ACT_MAX);
        const double r = v - p * scale;
        ss += r * r;
        xr[j] = static_cast<float>(p);
      }
      f[b] = std::sqrt(ss);
    }
  });
  // The folded scale c (vllm_csv.screens.fbgemm.FbgemmInt8Screen._fold_scale), or 0.0.
  double c = 0.0;
  if (B > 0 && std::all_of(kk.begin(), kk.end(), [&](int k) { return k == kk[0]; })) {
    const int j = kk[0] - 6;
    if (C_MIN_LOG2 <= j && j <= C_MAX_LOG2) {
      const double cc = std::ldexp(1.0, j);
      if (!(s_min * cc < S_MIN || s_max * cc >= std::ldexp(1.0, 127))) c = cc;
    }
  }
  at::Tensor row_scale = at::empty({B}, x.options());
  at::Tensor e = at::empty({B}, x.options());
  float* rs = row_scale.data_ptr<float>();
  float* ep = e.data_ptr<float>();
  const float slack = static_cast<float>(1.0 + 4.0 * std::ldexp(1.0, -24));
  for (int64_t b = 0; b < B; ++b) {
    const double scale = std::ldexp(1.0, kk[b] - 6);
    rs[b] = static_cast<float>(scale);
    double fb = f[b];
    if (c == 0.0 && s_min * scale < S_MIN) fb = fb + std::ldexp(1.0, -149) / s_min;
    ep[b] = round_up32(fb) * slack;
    float* xr = xp + b * (d + 2);
    const float cf = static_cast<float>(c == 0.0 ? 1.0 : c);
    for (int64_t j = 0; j < d; ++j) xr[j] = xr[j] * cf;  // exact: 7-bit integers times a power of two
    xr[d] = static_cast<float>(ACT_MIN * (c == 0.0 ? 1.0 : c));
    xr[d + 1] = static_cast<float>(ACT_MAX * (c == 0.0 ? 1.0 : c));
  }
  return {x, row_scale, e, c};
}

// Per row of y [B, V] float32: max |y_i| (NaN if the row has a NaN; +inf from +-inf), the value
// the screen's intervals scale their rounding margin by (vllm_csv.ops.rows.abs_max_rows_ref:
// max(max y, -min y), one pass instead of torch.aminmax's). fabs and max are exact: the same bits.
at::Tensor abs_max_rows(const at::Tensor& y_in) {
  TORCH_CHECK(y_in.dim() == 2 && y_in.scalar_type() == at::kFloat && y_in.device().is_cpu(),
              "abs_max_rows: y [B, V] float32 on the CPU");
  at::Tensor y = y_in.contiguous();
  const int64_t B = y.size(0), V = y.size(1);
  at::Tensor out = at::empty({B}, y.options());
  const float* yp = y.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* r = yp + b * V;
      float mx = 0.0f;
      int32_t nans = 0;
#pragma omp simd reduction(max : mx) reduction(+ : nans)
      for (int64_t i = 0; i < V; ++i) {
        const float a = std::fabs(r[i]);
        nans += a != a;
        mx = a > mx ? a : mx;
      }
      op[b] = nans ? std::numeric_limits<float>::quiet_NaN() : mx;
    }
  });
  return out;
}


// ---- interval_rows ---------------------------------------------------------------------------
// The screen's intervals around its centres y [B, V] (vllm_csv.ops.rows.interval_rows_ref,
// the same bits): m = (c_b [+ bslack_v]) + rad_v hnorm_b [+ nn_v e_b], then hi = y + m and,
// where two_sided, y - m written over y (the reference's y.sub_(m)). torch's CPU addcmul is
// compiled with its multiply-add fused (self + t1 t2 rounded once: checked against the reference
// in tests/test_rows.py), so the kernel fuses the same two explicitly (std::fma; inline
// instructions in the AVX2+FMA and AVX-512 clones). One pass over y instead of the reference's
// five (m built, widened, and read twice), and no [B, V] m.
void interval_tail(float* y, float* hi, int64_t n, float cb, const float* bs, const float* rad, float hb,
                   const float* nn, float eb, bool two_sided) {  // scalar: the tails, and CPUs without FMA
  for (int64_t i = 0; i < n; ++i) {
    float m = bs ? cb + bs[i] : cb;
    m = std::fma(rad[i], hb, m);
    if (nn) m = std::fma(nn[i], eb, m);
    const float v = y[i];
    hi[i] = v + m;
    if (two_sided) y[i] = v - m;
  }
}

#define CSV_INTERVAL_SPAN(NAME, TARGET, W, VT, SET1, LOAD, STORE, ADD, SUB, FMADD)                              \
  __attribute__((target(TARGET))) void NAME(float* y, float* hi, int64_t n, float cb, const float* bs,        \
                                            const float* rad, float hb, const float* nn, float eb,            \
                                            bool two_sided) {                                                 \
    const VT C = SET1(cb), H = SET1(hb), E = SET1(eb);                                                        \
    int64_t i = 0;                                                                                            \
    for (; i + W <= n; i += W) {                                                                              \
      VT m = bs ? ADD(C, LOAD(bs + i)) : C;                                                                   \
      m = FMADD(LOAD(rad + i), H, m);                                                                         \
      if (nn) m = FMADD(LOAD(nn + i), E, m);                                                                  \
      const VT v = LOAD(y + i);                                                                               \
      STORE(hi + i, ADD(v, m));                                                                               \
      if (two_sided) STORE(y + i, SUB(v, m));                                                                 \
    }                                                                                                         \
    interval_tail(y + i, hi + i, n - i, cb, bs ? bs + i : nullptr, rad + i, hb, nn ? nn + i : nullptr, eb,    \
                  two_sided);                                                                                 \
  }
#if defined(__x86_64__)
CSV_INTERVAL_SPAN(interval_span_avx512, "avx512f", 16, __m512, _mm512_set1_ps, _mm512_loadu_ps, _mm512_storeu_ps,
                  _mm512_add_ps, _mm512_sub_ps, _mm512_fmadd_ps)
CSV_INTERVAL_SPAN(interval_span_avx2, "avx2,fma", 8, __m256, _mm256_set1_ps, _mm256_loadu_ps, _mm256_storeu_ps,
                  _mm256_add_ps, _mm256_sub_ps, _mm256_fmadd_ps)
#endif
#undef CSV_INTERVAL_SPAN

using IntervalSpan = void (*)(float*, float*, int64_t, float, const float*, const float*, float, const float*, float,
                              bool);

IntervalSpan interval_span() {  // the widest the CPU runs (the multiply-adds fused in each, as torch's)
#if defined(__x86_64__)
  if (CSV_CPU_SUPPORTS("avx512f")) return interval_span_avx512;
  if (CSV_CPU_SUPPORTS("avx2") && CSV_CPU_SUPPORTS("fma")) return interval_span_avx2;
#endif
  return interval_tail;
}

at::Tensor interval_rows(at::Tensor& y, const at::Tensor& c, const at::Tensor& rad, const at::Tensor& hnorm,
                         const c10::optional<at::Tensor>& bslack, const c10::optional<at::Tensor>& nn,
                         const c10::optional<at::Tensor>& e, bool two_sided) {
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == at::kFloat && y.device().is_cpu() && y.is_contiguous(),
              "interval_rows: y [B, V] contiguous float32 on the CPU");
  const int64_t B = y.size(0), V = y.size(1);
  auto vec = [](const at::Tensor& t, int64_t n, const char* what) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == n && t.scalar_type() == at::kFloat, "interval_rows: ", what,
                " must be float32 [", n, "]");
    return t.contiguous();
  };
  const at::Tensor cc = vec(c, B, "c"), rr = vec(rad, V, "rad"), hh = vec(hnorm, B, "hnorm");
  TORCH_CHECK(nn.has_value() == e.has_value(), "interval_rows: nn and e come together");
  const at::Tensor bs = bslack.has_value() ? vec(*bslack, V, "bslack") : at::Tensor();
  const at::Tensor nv = nn.has_value() ? vec(*nn, V, "nn") : at::Tensor();
  const at::Tensor ev = e.has_value() ? vec(*e, B, "e") : at::Tensor();
  at::Tensor hi = at::empty_like(y);
  float* yp = y.data_ptr<float>();
  float* hp = hi.data_ptr<float>();
  const float *cp = cc.data_ptr<float>(), *rp = rr.data_ptr<float>(), *np = hh.data_ptr<float>();
  const float* bp = bslack.has_value() ? bs.data_ptr<float>() : nullptr;
  const float* nvp = nn.has_value() ? nv.data_ptr<float>() : nullptr;
  const float* ep = e.has_value() ? ev.data_ptr<float>() : nullptr;
  // split over rows and column blocks: eight rows on two threads keep both busy
  const int64_t COLS = 4096, nb = (V + COLS - 1) / COLS;
  static const IntervalSpan span = interval_span();
  at::parallel_for(0, B * nb, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / nb, i0 = (t % nb) * COLS, i1 = std::min(V, i0 + COLS);
      span(yp + b * V + i0, hp + b * V + i0, i1 - i0, cp[b], bp ? bp + i0 : nullptr, rp + i0, np[b],
                    nvp ? nvp + i0 : nullptr, ep ? ep[b] : 0.0f, two_sided);
    }
  });
  return hi;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_csv_cpu, m) {
  m.def("abs_max_rows(Tensor y) -> Tensor");
  m.def("outlier_rows(Tensor h, float ratio, int m) -> Tensor");
  m.def("interval_rows(Tensor(a!) y, Tensor c, Tensor rad, Tensor hnorm, Tensor? bslack, Tensor? nn, Tensor? e, "
        "bool two_sided) -> Tensor");
  m.def("prepare_rows(Tensor h, bool certifiable) -> (Tensor, Tensor, Tensor)");
  m.def("quantize_act7(Tensor h, float s_min, float s_max) -> (Tensor, Tensor, Tensor, float)");
}

TORCH_LIBRARY_IMPL(vllm_csv_cpu, CPU, m) {
  m.impl("prepare_rows", &prepare_rows);
  m.impl("abs_max_rows", &abs_max_rows);
  m.impl("outlier_rows", &outlier_rows);
  m.impl("interval_rows", &interval_rows);
  m.impl("quantize_act7", &quantize_act7);
}
