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
//
// draw_contenders: the certificate's whole pass over sampled rows (its thresholds, the pass
// above, the candidates' noisy bounds, best, winner, contenders) in one call; see below.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "isa.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

// chunk_keep with AVX-512 intrinsics, 8 tokens a step: the same integer hash (64-bit lanes, products
// mod 2^64), the same float64 level (exact conversion, subtraction, product by a power of two,
// floor, clamp) and the same signed comparison with the gathered threshold; the tail (m % 8) and
// the compiler's own version take chunk_keep. (GCC does not vectorise chunk_keep's loop.)
__attribute__((target("avx512f,avx512dq"))) void chunk_keep_avx512(CHUNK_ARGS) {
  const __m512i vkey = _mm512_set1_epi64(static_cast<int64_t>(key));
  const __m512i gold = _mm512_set1_epi64(static_cast<int64_t>(GOLDEN));
  const __m512i mul1 = _mm512_set1_epi64(static_cast<int64_t>(0xBF58476D1CE4E5B9ULL));
  const __m512i mul2 = _mm512_set1_epi64(static_cast<int64_t>(0x94D049BB133111EBULL));
  const __m512i one = _mm512_set1_epi64(1), lane = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
  const __m512d vhm = _mm512_set1_pd(hm), vinv = _mm512_set1_pd(inv_level);
  const __m512d vtop = _mm512_set1_pd(static_cast<double>(levels)), vzero = _mm512_setzero_pd();
  const __m512d vneg = _mm512_set1_pd(-std::numeric_limits<double>::infinity());
  int64_t j = 0;
  for (; j + 8 <= m; j += 8) {
    const __m512i id = ids ? _mm512_loadu_si512(ids + j) : _mm512_add_epi64(_mm512_set1_epi64(id0 + j), lane);
    __m512i z = _mm512_add_epi64(vkey, _mm512_mullo_epi64(_mm512_add_epi64(id, one), gold));
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), mul1);
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), mul2);
    z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
    const __m512i b = _mm512_srli_epi64(z, 11);
    const __m512d hd = _mm512_cvtps_pd(_mm256_loadu_ps(h + j));
    const __mmask8 live = _mm512_cmp_pd_mask(hd, vneg, _CMP_GT_OQ);  // NaN and -inf: not live
    __m512d g = _mm512_roundscale_pd(_mm512_mul_pd(_mm512_sub_pd(vhm, hd), vinv), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    g = _mm512_mask_blend_pd(live, vtop, _mm512_min_pd(_mm512_max_pd(g, vzero), vtop));
    const __m512i thr = _mm512_i64gather_epi64(_mm512_cvttpd_epi64(g), table, 8);
    const __mmask8 k = _mm512_mask_cmp_epi64_mask(live, b, thr, _MM_CMPINT_NLT);
    _mm512_storeu_si512(out + j, b);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(keep + j), _mm512_cvtepi64_epi8(_mm512_maskz_set1_epi64(k, 1)));
  }
  if (j < m) {
    if (ids) chunk_keep<false>(key, id0 + j, ids + j, h + j, hm, inv_level, table, levels, m - j, out + j, keep + j);
    else chunk_keep<true>(key, id0 + j, nullptr, h + j, hm, inv_level, table, levels, m - j, out + j, keep + j);
  }
}

void chunk_keep_any(CHUNK_ARGS) {
  if (ids) CHUNK_CALL(false);
  else CHUNK_CALL(true);
}

static const bool AVX512_DQ = CSV_CPU_SUPPORTS("avx512f") && CSV_CPU_SUPPORTS("avx512dq");

// One row of noise_candidates: the kept columns (ascending) and their bits appended to cr, br.
// forced: columns kept whatever their bits, ascending.
void row_candidates(uint64_t key, const float* h, const int64_t* tok, int64_t n, double hm, double inv_level,
                    const int64_t* table, int64_t levels, const std::vector<int64_t>& forced,
                    std::vector<int64_t>& cr, std::vector<int64_t>& br) {
  size_t next = 0;
  int64_t buf[CHUNK];
  uint8_t keep[CHUNK];
  for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
    const int64_t m = std::min(CHUNK, n - c0);
    (AVX512_DQ ? chunk_keep_avx512 : chunk_keep_any)(key, c0, tok ? tok + c0 : nullptr, h + c0, hm, inv_level, table,
                                                     levels, m, buf, keep);
    for (; next < forced.size() && forced[next] < c0 + m; ++next)
      if (forced[next] >= c0) keep[forced[next] - c0] = 1;
    for (int64_t j = 0; j < m; ++j) {
      if ((j & 7) == 0 && j + 8 <= m) {  // eight tokens none of which is kept: skip them
        uint64_t w;
        std::memcpy(&w, keep + j, 8);
        if (w == 0) {
          j += 7;
          continue;
        }
      }
      if (keep[j]) {
        cr.push_back(c0 + j);
        br.push_back(buf[j]);
      }
    }
  }
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

  std::vector<std::vector<int64_t>> cols(R), bits(R);
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      std::vector<int64_t> fr;  // forced columns, ascending
      for (int64_t j = 0; j < nf; ++j)
        if (fp[r * nf + j] >= 0) fr.push_back(fp[r * nf + j]);
      std::sort(fr.begin(), fr.end());
      row_candidates(splitmix64(static_cast<uint64_t>(sp[r])), hp + r * n, ip ? ip + r * n : nullptr, n,
                     static_cast<double>(mp[r]), inv_level, tp + r * (levels + 1), levels, fr, cols[r], bits[r]);
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

// g = -log(-log u), u = (bits + 0.5) 2^-53, in float64 (vllm_csv.sampling.gumbel.noise_of_bits:
// the same operations; std::log and torch's log may differ by an ulp, which noise_margin covers).
inline double noise_of_bits(int64_t bits) {
  const double u = (static_cast<double>(bits) + 0.5) * 0x1p-53;
  return -std::log(-std::log(u));
}

// vllm_csv.sampling.gumbel.bits_below, one threshold (the same float64 operations).
inline int64_t bits_below(double t) {
  if (std::isnan(t)) t = -std::numeric_limits<double>::infinity();
  const double u = std::exp(-std::exp(-(t - 1e-6)));
  const double b = std::floor(u * 0x1p53 - 0.5) - 2;
  return static_cast<int64_t>(std::min(std::max(b, -1.0), 0x1p53));
}

// The sampled rows' part of the draw certificate (vllm_csv.ops.noise.draw_contenders_ref, which
// says what each output is; vllm_csv/sampling/certificate.py, the proof): per row, the threshold
// table from the noisy lower bounds of its top tokens, the candidates (row_candidates, as
// noise_candidates), their noisy bounds in float64, the best noisy lower bound, the winner (the
// lowest column attaining it) and the contenders (noisy upper bound >= best - 2 delta). One call
// where the reference takes about sixty torch ops.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> draw_contenders(
    const at::Tensor& lo_in, const at::Tensor& hi_in, const at::Tensor& seeds_in, const at::Tensor& hmax_in,
    const at::Tensor& delta_in, const at::Tensor& top_v_in, const at::Tensor& top_i_in,
    const c10::optional<at::Tensor>& ids_in, bool direct, double level, int64_t levels) {
  TORCH_CHECK(hi_in.dim() == 2 && hi_in.scalar_type() == at::kFloat && hi_in.device().is_cpu() &&
                  lo_in.sizes() == hi_in.sizes() && lo_in.scalar_type() == at::kFloat && lo_in.device().is_cpu(),
              "draw_contenders: lo, hi [R, n] float32 on the CPU");
  at::Tensor lo = lo_in.contiguous(), hi = hi_in.contiguous();
  const int64_t R = hi.size(0), n = hi.size(1);
  at::Tensor seeds = seeds_in.to(at::kLong).contiguous(), hmax = hmax_in.to(at::kFloat).contiguous();
  at::Tensor delta = delta_in.to(at::kDouble).contiguous();
  at::Tensor top_v = top_v_in.to(at::kFloat).contiguous(), top_i = top_i_in.to(at::kLong).contiguous();
  TORCH_CHECK(seeds.numel() == R && hmax.numel() == R && delta.numel() == R, "draw_contenders: seeds, hmax, delta [R]");
  TORCH_CHECK(top_v.dim() == 2 && top_v.size(0) == R && top_i.sizes() == top_v.sizes(),
              "draw_contenders: top_v, top_i [R, k]");
  TORCH_CHECK(levels >= 0 && level > 0, "draw_contenders: levels >= 0, level > 0");
  at::Tensor ids;
  if (ids_in.has_value()) {
    ids = ids_in->to(at::kLong).contiguous();
    TORCH_CHECK(ids.sizes() == hi.sizes(), "draw_contenders: ids [R, n] like hi");
  }
  const int64_t k = top_v.size(1);
  const float *lp = lo.data_ptr<float>(), *hp = hi.data_ptr<float>(), *mp = hmax.data_ptr<float>();
  const float* vp = top_v.data_ptr<float>();
  const int64_t *sp = seeds.data_ptr<int64_t>(), *tip = top_i.data_ptr<int64_t>();
  const int64_t* ip = ids.defined() ? ids.data_ptr<int64_t>() : nullptr;
  const double* dp = delta.data_ptr<double>();
  const double inf = std::numeric_limits<double>::infinity();

  at::Tensor best = at::empty({R}, delta.options()), win = at::empty({R}, seeds.options());
  at::Tensor ncont = at::empty({R}, seeds.options());
  double* bp = best.data_ptr<double>();
  int64_t *wp = win.data_ptr<int64_t>(), *np = ncont.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> conts(R);
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> table, forced, cols, bits;
    for (int64_t r = r0; r < r1; ++r) {
      const uint64_t key = splitmix64(static_cast<uint64_t>(sp[r]));
      const float* h = hp + r * n;
      const float* l = lp + r * n;
      const int64_t* tok = ip ? ip + r * n : nullptr;
      const double d = dp[r];
      int64_t lv = 0;
      forced.clear();
      if (direct) {  // every live token: a threshold that keeps all
        table.assign(1, -1);
      } else {
        double L = -inf;  // the noisy lower bounds of the top tokens (max: <= best)
        for (int64_t j = 0; j < k; ++j) {
          const float v = vp[r * k + j];
          const int64_t c = tip[r * k + j];
          if (v > -std::numeric_limits<float>::infinity()) forced.push_back(c);
          const uint64_t id = static_cast<uint64_t>(tok ? tok[c] : c);
          const double g = noise_of_bits(static_cast<int64_t>(splitmix64(key + (id + 1) * GOLDEN) >> 11));
          L = std::max(L, static_cast<double>(v) + g);
        }
        std::sort(forced.begin(), forced.end());
        forced.erase(std::unique(forced.begin(), forced.end()), forced.end());
        const double t = L - 2 * d - static_cast<double>(mp[r]);
        lv = levels;
        table.resize(levels + 1);
        for (int64_t q = 0; q <= levels; ++q)
          table[q] = bits_below(t + std::max(static_cast<double>(q) - 0.01, 0.0) * level);
      }
      cols.clear();
      bits.clear();
      row_candidates(key, h, tok, n, static_cast<double>(mp[r]), 1.0 / level, table.data(), lv, forced, cols, bits);
      const size_t m = cols.size();
      std::vector<double> nhi(m);
      double bst = -inf;
      int64_t w = n;
      for (size_t j = 0; j < m; ++j) {
        const double g = noise_of_bits(bits[j]);
        const double nl = static_cast<double>(l[cols[j]]) + g;
        nhi[j] = static_cast<double>(h[cols[j]]) + g;
        if (nl > bst || (nl == bst && cols[j] < w)) {  // (columns ascending: the first attaining the max)
          bst = nl;
          w = cols[j];
        }
      }
      const double bar = bst - 2 * d;
      int64_t nc = 0;
      for (size_t j = 0; j < m; ++j)
        if (nhi[j] >= bar) {
          conts[r].push_back(cols[j]);
          ++nc;
        }
      bp[r] = bst;
      wp[r] = w;
      np[r] = nc;
    }
  });
  int64_t m = 0;
  for (int64_t r = 0; r < R; ++r) m += static_cast<int64_t>(conts[r].size());
  at::Tensor ri = at::empty({m}, seeds.options()), ci = at::empty({m}, seeds.options());
  int64_t *rp = ri.data_ptr<int64_t>(), *cp = ci.data_ptr<int64_t>();
  for (int64_t r = 0, q = 0; r < R; ++r)
    for (size_t j = 0; j < conts[r].size(); ++j, ++q) {
      rp[q] = r;
      cp[q] = conts[r][j];
    }
  return {best, win, ncont, ri, ci};
}

// The 53 noise bits of tokens ids ([R, n], or [n] for every row) in rows seeded seeds ([R]):
// vllm_csv.sampling.gumbel.noise_bits, in one pass (integer arithmetic: identical).
at::Tensor noise_bits(const at::Tensor& seeds_in, const at::Tensor& ids_in) {
  TORCH_CHECK(seeds_in.device().is_cpu() && ids_in.device().is_cpu(), "noise_bits: CPU tensors");
  at::Tensor seeds = seeds_in.to(at::kLong).contiguous(), ids = ids_in.to(at::kLong).contiguous();
  const int64_t R = seeds.numel();
  TORCH_CHECK(ids.dim() == 1 || (ids.dim() == 2 && ids.size(0) == R), "noise_bits: ids [R, n] or [n]");
  const bool shared = ids.dim() == 1;
  const int64_t n = ids.size(-1);
  at::Tensor out = at::empty({R, n}, seeds.options());
  const int64_t* sp = seeds.data_ptr<int64_t>();
  const int64_t* ip = ids.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint64_t key = splitmix64(static_cast<uint64_t>(sp[r]));
      const int64_t* tok = shared ? ip : ip + r * n;
      for (int64_t j = 0; j < n; ++j)
        op[r * n + j] = static_cast<int64_t>(splitmix64(key + (static_cast<uint64_t>(tok[j]) + 1) * GOLDEN) >> 11);
    }
  });
  return out;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_csv_cpu, m) {
  m.def("noise_candidates(Tensor hi, Tensor seeds, Tensor hmax, Tensor table, Tensor force, Tensor? ids, "
        "float inv_level) -> (Tensor, Tensor, Tensor)");
  m.def("noise_bits(Tensor seeds, Tensor ids) -> Tensor");
  m.def("draw_contenders(Tensor lo, Tensor hi, Tensor seeds, Tensor hmax, Tensor delta, Tensor top_v, Tensor top_i, "
        "Tensor? ids, bool direct, float level, int levels) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(vllm_csv_cpu, CPU, m) {
  m.impl("noise_candidates", &noise_candidates);
  m.impl("noise_bits", &noise_bits);
  m.impl("draw_contenders", &draw_contenders);
}
