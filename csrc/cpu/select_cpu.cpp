// CPU kernel of the certified step's candidate search, after the screen and its per-row passes
// (rows_cpu.cpp) and before the exact scores and the certificate (csv_cpu.cpp):
//
// * select_candidates: the two-sided threshold search over the screen's block maxima (one read
//   of y as block maxima, the row's threshold from its largest and k-th largest, the candidate
//   blocks, then the candidates within them).
//
// Why fused: as the step's other kernels (csv_cpu.cpp): after the screen's GEMM every small torch
// op runs cold, and the reference's search takes many (block maxima, top-k, the threshold's fp32
// operations, the candidate masks).
//
// Its torch reference is vllm_csv/ops/select.py (select_candidates_ref, same signature, and the
// proof of its bounds there); the arithmetic here follows it operation by operation (fp32, with
// scalars rounded to fp32 as torch rounds them), so that the outputs match bit for bit. Built with
// -ffp-contract=off: no fused multiply-adds the reference lacks.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "fp32.h"
#include "isa.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <tuple>
#include <vector>

namespace {

using namespace csv_fp32;

// The constant comes from its one place in Python (vllm_csv/ops/build.py passes it).
constexpr int64_t BLOCK = CSV_BLOCK;  // vllm_csv.ops.build.BLOCK

// max of r[0, n) (NaN if any is NaN), in LANES independent lanes so that the compiler
// vectorises it (a single running max is a loop-carried dependence it will not reorder).
constexpr int LANES = 16;

// (The body is inlined into one function per ISA, each vectorised for its target; block_max
// picks the widest that CSV_CPU_SUPPORTS allows: target_clones would dispatch past the cap.)
inline __attribute__((always_inline)) float block_max_body(const float* r, int64_t n) {
  float m[LANES], bad[LANES];
  for (int l = 0; l < LANES; ++l) m[l] = -INF32, bad[l] = 0.0f;
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; ++l) {
      const float v = r[i + l];
      m[l] = v > m[l] ? v : m[l];
      bad[l] += v - v;  // 0, or NaN where v is NaN or infinite
    }
  float out = -INF32, any_bad = 0.0f;
  for (int l = 0; l < LANES; ++l) out = m[l] > out ? m[l] : out, any_bad += bad[l];
  for (; i < n; ++i) {
    out = r[i] > out ? r[i] : out;
    any_bad += r[i] - r[i];
  }
  if (any_bad != any_bad)  // a NaN or an infinity: NaN propagates (infinities are maxima already)
    for (int64_t q = 0; q < n; ++q)
      if (r[q] != r[q]) return NAN32;
  return out;
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) float block_max_avx512(const float* r, int64_t n) { return block_max_body(r, n); }
__attribute__((target("avx2"))) float block_max_avx2(const float* r, int64_t n) { return block_max_body(r, n); }
#endif
float block_max_any(const float* r, int64_t n) { return block_max_body(r, n); }

float block_max(const float* r, int64_t n) {
#if defined(__x86_64__)
  static const auto fn = CSV_CPU_SUPPORTS("avx512f") ? block_max_avx512
                                                     : (CSV_CPU_SUPPORTS("avx2") ? block_max_avx2 : block_max_any);
  return fn(r, n);
#else
  return block_max_any(r, n);
#endif
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> select_candidates(
    const at::Tensor& y_in, const c10::optional<at::Tensor>& row_scale, const c10::optional<at::Tensor>& bmax_in,
    const at::Tensor& k_in, const at::Tensor& hnorm_in, const c10::optional<at::Tensor>& e_in, const at::Tensor& ok_in,
    double rad_max,
    double act_coef, double tiny, double bslack_max, double delta, double limit, double babs_max, int64_t budget) {
  TORCH_CHECK(y_in.dim() == 2 && y_in.scalar_type() == at::kFloat && y_in.device().is_cpu(),
              "select_candidates: y [B, V] float32 on the CPU");
  at::Tensor y = y_in.contiguous();
  const int64_t B = y.size(0), V = y.size(1);
  const int64_t nb = (V + BLOCK - 1) / BLOCK;
  const float* yp = y.data_ptr<float>();
  at::Tensor kt = k_in.to(at::kLong).contiguous();
  const int64_t* kp = kt.data_ptr<int64_t>();
  at::Tensor hnt = hnorm_in.to(at::kFloat).contiguous();
  const float* hn = hnt.data_ptr<float>();
  at::Tensor et, rst;
  const float* ep = nullptr;
  const float* rsp = nullptr;
  if (e_in.has_value() && e_in->defined()) {
    et = e_in->to(at::kFloat).contiguous();
    ep = et.data_ptr<float>();
  }
  if (row_scale.has_value() && row_scale->defined()) {
    rst = row_scale->to(at::kFloat).contiguous();
    rsp = rst.data_ptr<float>();
  }
  at::Tensor ok = ok_in.to(at::kBool).clone();
  bool* okp = ok.data_ptr<bool>();
  at::Tensor tau_t = at::empty({B}, y.options());
  float* tau = tau_t.data_ptr<float>();
  at::Tensor live_t = at::zeros({B}, ok.options());
  bool* livep = live_t.data_ptr<bool>();

  // Scalars as torch rounds a Python float operand of an fp32 op.
  const float deltaf = static_cast<float>(delta), tinyf = static_cast<float>(tiny);
  const float radf = static_cast<float>(rad_max), bslf = static_cast<float>(bslack_max);
  const float babsf = static_cast<float>(babs_max), limf = static_cast<float>(limit);
  const float actf = static_cast<float>(act_coef);
  const float up = static_cast<float>(1.0 + delta), dn = static_cast<float>(1.0 - delta);
  const float eightu = static_cast<float>(8.0 * std::ldexp(1.0, -24));

  // One read of y: block maxima (NaN propagates, as torch.amax), scaled by the row's scale;
  // given (the GEMM took them in the same pass), only scaled.
  std::vector<float> bmax(B * nb);
  const float* given = nullptr;
  at::Tensor bmt;
  if (bmax_in.has_value() && bmax_in->defined()) {
    TORCH_CHECK(bmax_in->dim() == 2 && bmax_in->size(0) == B && bmax_in->size(1) == nb &&
                    bmax_in->scalar_type() == at::kFloat, "select_candidates: bmax [B, ceil(V / BLOCK)] float32");
    bmt = bmax_in->contiguous();
    given = bmt.data_ptr<float>();
  }
  at::parallel_for(0, B * nb, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t q = lo; q < hi; ++q) {
      const int64_t b = q / nb, j = q % nb;
      const float* r = yp + b * V + j * BLOCK;
      const int64_t n = std::min(BLOCK, V - j * BLOCK);
      float m = given ? given[q] : block_max(r, n);
      bmax[q] = rsp ? m * rsp[b] : m;
    }
  });

  std::vector<float> thr(B, NAN32);
  int64_t kmax = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(kp[b] >= 1, "select_candidates: k >= 1");
    kmax = std::max(kmax, kp[b]);
  }
  for (int64_t b = 0; b < B; ++b) {
    const int64_t k = kp[b];
    const float* bm = bmax.data() + b * nb;
    float y1, yk;
    bool nan = false;
    for (int64_t j = 0; j < nb; ++j) nan |= bm[j] != bm[j];
    if (nan) {
      y1 = yk = NAN32;
    } else if (kmax <= nb) {  // the k-th largest block maximum: k distinct tokens reach it
      std::vector<float> top(bm, bm + nb);
      std::nth_element(top.begin(), top.begin() + (k - 1), top.end(), std::greater<float>());
      yk = top[k - 1];
      y1 = *std::max_element(bm, bm + nb);
    } else {  // fewer blocks than k: the exact k-th value of the row
      std::vector<float> top(yp + b * V, yp + (b + 1) * V);
      for (auto& v : top) nan |= v != v;
      if (rsp)
        for (auto& v : top) v = v * rsp[b];
      std::nth_element(top.begin(), top.begin() + (k - 1), top.end(), std::greater<float>());
      yk = top[k - 1];
      y1 = *std::max_element(top.begin(), top.end());
      if (nan) y1 = yk = NAN32;
    }
    const float act = ep ? actf * ep[b] : 0.0f;
    float spread = radf * hn[b];
    spread = spread + act;
    spread = spread + tinyf;
    spread = spread + bslf;
    float top1 = y1 + deltaf * std::fabs(y1);
    top1 = top1 + spread;
    top1 = top1 + babsf;
    okp[b] = okp[b] && (top1 <= limf);  // false on NaN
    float t = yk - deltaf * std::fabs(yk);
    t = t - spread;
    tau[b] = t;
    const float s = t - spread;
    float th = s >= 0 ? s / up : s / dn;
    th = th - std::fabs(th) * eightu;
    th = th - tinyf;
    thr[b] = okp[b] ? th : NAN32;
    int64_t cnt = 0;
    for (int64_t j = 0; j < nb; ++j) cnt += bm[j] >= thr[b];
    livep[b] = cnt <= budget;
  }
  // Candidate blocks: those of live rows (of the row itself at B = 1).
  std::vector<char> use(B);
  for (int64_t b = 0; b < B; ++b) use[b] = B == 1 || livep[b];
  std::vector<int64_t> blocks;
  for (int64_t j = 0; j < nb; ++j) {
    for (int64_t b = 0; b < B; ++b) {
      if (use[b] && bmax[b * nb + j] >= thr[b]) {
        blocks.push_back(j);
        break;
      }
    }
  }
  // Candidates per row within those blocks; rows over the budget are not live.
  std::vector<char> cand(B * blocks.size() * BLOCK, 0);
  const int64_t nc = static_cast<int64_t>(blocks.size()) * BLOCK;
  for (int64_t b = 0; b < B; ++b) {
    int64_t cnt = 0;
    const float* r = yp + b * V;
    const float tb = thr[b];
    for (size_t q = 0; q < blocks.size(); ++q) {
      const int64_t j0 = blocks[q] * BLOCK, n = std::min(BLOCK, V - j0);
      for (int64_t i = 0; i < n; ++i) {
        const float v = rsp ? r[j0 + i] * rsp[b] : r[j0 + i];
        const bool c = v >= tb;
        cand[b * nc + q * BLOCK + i] = c;
        cnt += c;
      }
    }
    livep[b] = livep[b] && cnt <= budget;
  }
  std::vector<int64_t> ids;
  for (size_t q = 0; q < blocks.size(); ++q) {
    const int64_t j0 = blocks[q] * BLOCK, n = std::min(BLOCK, V - j0);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t b = 0; b < B; ++b) {
        if ((B == 1 || livep[b]) && cand[b * nc + q * BLOCK + i]) {
          ids.push_back(j0 + i);
          break;
        }
      }
    }
  }
  at::Tensor ids_t = at::empty({static_cast<int64_t>(ids.size())}, y.options().dtype(at::kLong));
  std::copy(ids.begin(), ids.end(), ids_t.data_ptr<int64_t>());
  return {ids_t, tau_t, ok, live_t};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_csv_cpu, m) {
  m.def(
      "select_candidates(Tensor y, Tensor? row_scale, Tensor? bmax, Tensor k, Tensor hnorm, Tensor? e, Tensor ok, float rad_max, "
      "float act_coef, float tiny, float bslack_max, float delta, float limit, float babs_max, int budget) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(vllm_csv_cpu, CPU, m) { m.impl("select_candidates", &select_candidates); }
