// The int8 screen's GEMM with AVX512-VNNI (vpdpbusd), for the batches a decode step has.
//
// Computes exactly what FBGEMM's dynamic int8 linear returns for the screen's inputs
// (vllm_csv/ops/fbgemm.py, vllm_csv/ops/int8_vnni.py):
//
//   y[b, i] = fl(fl(A[b, i]) * fl(c * s[i])),  A[b, i] = sum_k (code[b, k] - 64) * q[i, k]
//
// with uint8 codes in [0, 127] (the 7-bit activations p + 64), int8 q, fp32 s and a power of two
// c. vpdpbusd multiplies unsigned by signed bytes and adds groups of four into int32 lanes
// without saturation; |sum_k code * q| <= 127 * 128 * d < 2^31 for the d the caller allows, so
// the int32 sums are exact, and A = sum code * q - 64 * rowsum(q) is exact in int32 too.
// cvtdq2ps and mulps round to nearest even (MXCSR's default, which torch leaves alone): the
// same two roundings as FBGEMM's ReQuantizeForFloat and the torch reference.
//
// Weight layout (pack_int8_vnni, int8_layout.h): rows in tiles of 16 (a zmm's int32 lanes), k in
// groups of 4, a tile of one group is one 64-byte vector [16 rows][4 k] (vpdpbusd's operand); two
// tiles make a panel of 32 rows, interleaved group by group, and panels follow each other, so a
// thread streams its row range once. Rows past V and k past d are zero. Where the CPU has no
// AVX512-VNNI, int8_vnni_linear runs the AVX2 kernel (int8_avx2.cpp) on the same layout: same bits.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "int8_layout.h"
#include "isa.h"

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <algorithm>
#include <atomic>
#include <tuple>
#include <vector>

// Bytes ahead of the weight stream that the screens' kernels prefetch (prefetcht0, one line per
// line read; a prefetch past the weight's end is a hint and never faults): CSV_PREFETCH
// (vllm_csv.ops.build.PREFETCH) on Intel CPUs, where it measured 5-30% faster than the hardware
// prefetcher alone, nothing elsewhere (on AMD EPYC software prefetches measured 15% slower); the
// measurements: benchmarks/README.md, "Software prefetch in the screens' kernels".
std::atomic<int64_t>& prefetch_bytes() {
  static std::atomic<int64_t> bytes{[] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") ? (int64_t)CSV_PREFETCH : (int64_t)0;
  }()};
  return bytes;
}

int64_t prefetch_ahead() { return prefetch_bytes().load(std::memory_order_relaxed); }

// For benchmarks (benchmarks/prefetch_cpu.py): sets the distance (0: off, else a multiple of 64
// bytes) for later calls; returns the previous one.
int64_t set_prefetch_ahead(int64_t bytes) {
  TORCH_CHECK(bytes >= 0 && bytes % 64 == 0 && bytes <= (1 << 20), "prefetch distance: 0 or a multiple of 64, at most 1 MiB");
  return prefetch_bytes().exchange(bytes);
}

namespace {

using csv_int8::GROUP;
using csv_int8::PANEL;
using csv_int8::TILE;
constexpr int64_t BT = 8;  // batch rows a pass keeps in registers

bool cpu_has_vnni() {
  __builtin_cpu_init();
  return CSV_CPU_SUPPORTS("avx512f") && CSV_CPU_SUPPORTS("avx512bw") &&
         CSV_CPU_SUPPORTS("avx512vnni");
}

// One panel (32 rows, two tiles) for NB batch rows: acc0[b], acc1[b] = sum_k code[b, k] q[row, k]
// for the panel's two tiles. Each broadcast activation group feeds both tiles, whose vpdpbusd
// chains are independent; the panel is one sequential stream of 128 bytes a group, prefetched pf
// bytes ahead (prefetch_ahead; a prefetch past the weight's end is a hint and never faults).
template <int NB>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void panel_dot(
    const int8_t* w, const uint32_t* codes, int64_t groups, int64_t pf, __m512i* acc0, __m512i* acc1) {
  for (int b = 0; b < NB; ++b) acc0[b] = acc1[b] = _mm512_setzero_si512();
  for (int64_t g = 0; g < groups; ++g) {
    if (pf > 0) {
      _mm_prefetch(reinterpret_cast<const char*>(w + g * 128 + pf), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + g * 128 + 64 + pf), _MM_HINT_T0);
    }
    const __m512i x0 = _mm512_loadu_si512(w + g * 128);
    const __m512i x1 = _mm512_loadu_si512(w + g * 128 + 64);
    for (int b = 0; b < NB; ++b) {
      const __m512i a = _mm512_set1_epi32(codes[b * groups + g]);
      acc0[b] = _mm512_dpbusd_epi32(acc0[b], a, x0);
      acc1[b] = _mm512_dpbusd_epi32(acc1[b], a, x1);
    }
  }
}

// y[b, rows r0 .. r0 + 15] = fl(fl(acc[b] - 64 rowsum) * fl(c s_i)); rows past V are neither
// stored nor counted in the running block maxima mx[b] (nan[b]: a NaN was seen, as torch's amax
// propagates it).
template <int NB>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void store_tile(
    const __m512i* acc, const int32_t* zsum, const float* sv, float c, float* y, int64_t V, int64_t r0,
    __m512* mx, __mmask16* nan) {
  if (r0 >= V) return;
  const __m512i z = _mm512_loadu_si512(zsum + r0);                               // 64 * rowsum(q)
  const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(sv + r0), _mm512_set1_ps(c));  // fl(c * s_i)
  const int64_t n = V - r0 < TILE ? V - r0 : TILE;
  const __mmask16 m = n == TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
  for (int b = 0; b < NB; ++b) {
    const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[b], z)), s);
    _mm512_mask_storeu_ps(y + b * V + r0, m, v);
    mx[b] = _mm512_mask_max_ps(mx[b], m, mx[b], v);
    nan[b] |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
  }
}

// Chunks k0 .. k1 of ppc panels each: y, and (bmax not null) each chunk's maximum per batch row,
// bmax[b, k] (a chunk is one block of the candidate search when ppc = block / 32).
template <int NB>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void panels(
    const int8_t* packed, const int32_t* zsum, const float* sv, float c, const uint32_t* codes, float* y,
    int64_t groups, int64_t V, int64_t np, int64_t ppc, int64_t k0, int64_t k1, float* bmax, int64_t nblk,
    int64_t pf) {
  __m512i acc0[NB], acc1[NB];
  __m512 mx[NB];
  __mmask16 nan[NB];
  for (int64_t k = k0; k < k1; ++k) {
    for (int b = 0; b < NB; ++b) {
      mx[b] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      nan[b] = 0;
    }
    const int64_t pe = (k + 1) * ppc < np ? (k + 1) * ppc : np;
    for (int64_t p = k * ppc; p < pe; ++p) {
      panel_dot<NB>(packed + p * groups * 128, codes, groups, pf, acc0, acc1);
      store_tile<NB>(acc0, zsum, sv, c, y, V, p * PANEL, mx, nan);
      store_tile<NB>(acc1, zsum, sv, c, y, V, p * PANEL + TILE, mx, nan);
    }
    if (bmax != nullptr)
      for (int b = 0; b < NB; ++b)
        bmax[b * nblk + k] = nan[b] ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(mx[b]);
  }
}

using PanelFn = void (*)(const int8_t*, const int32_t*, const float*, float, const uint32_t*, float*, int64_t,
                         int64_t, int64_t, int64_t, int64_t, int64_t, float*, int64_t, int64_t);
const PanelFn PANEL_FNS[BT] = {panels<1>, panels<2>, panels<3>, panels<4>, panels<5>, panels<6>, panels<7>, panels<8>};


// ---- AMX (tdpbusd): the same sums, one weight pass for up to MT batch rows a tile ----
//
// On CPUs with AMX-INT8 (Intel Sapphire Rapids and later) a tile multiply does 16 x 16 x 64
// multiply-adds of unsigned by signed bytes into int32, summed in groups of four like vpdpbusd
// and as exact (no saturation, the same bound on |A|): the int32 sums, and so y and the block
// maxima, are bit for bit those of the VNNI kernel above. It reads the same packed weight: a
// tile of one panel, over 16 groups (64 k), is 16 rows of 64 bytes at a stride of 128 (the
// panel's two tiles interleave by group), exactly tdpbusd's B operand. Groups past the last
// whole 16 (d not a multiple of 64) are added with vpdpbusd before the rescale. The VNNI kernel
// makes one pass over the weight per 8 batch rows and is bound by its vpdpbusd count from about
// 8 rows; this one is bound by the weight's bytes up to far larger batches.

constexpr int64_t MT = 16;  // batch rows a tile (the A and C tiles' rows)
constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// AMX-TILE and AMX-INT8 in CPUID (leaf 7, EDX bits 24 and 25), and the kernel's permission to
// use the tile data state (Linux asks each process to request it; asked once).
bool cpu_has_amx() {
  static const bool ok = [] {
    if (!cpu_has_vnni()) return false;  // (the tail groups and the rescale are AVX-512)
    if (!csv_isa::allows("amx")) return false;  // (VLLM_CSV_CPU_ISA=avx512 or avx2)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 24) & 1) || !((d >> 25) & 1)) return false;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// Chunks k0 .. k1 (as panels<NB>), every batch row: codes are [nbt * MT, 4 groups] (rows past B
// zero), codes32 the same as uint32 groups. C tiles 0 and 1 (the panel's two weight tiles), A
// tile 2, B tiles 3 and 4.
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vnni"))) void panels_amx(
    const int8_t* packed, const int32_t* zsum, const float* sv, float c, const uint8_t* codes, float* y,
    int64_t B, int64_t groups, int64_t V, int64_t np, int64_t ppc, int64_t k0, int64_t k1, float* bmax,
    int64_t nblk, int64_t pf) {
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  const int64_t nkb = groups / 16, nbt = (B + MT - 1) / MT, rowb = groups * GROUP;
  const uint32_t* codes32 = reinterpret_cast<const uint32_t*>(codes);
  alignas(64) int32_t buf[2][MT][TILE];
  // running block maxima per batch row (16 lanes each; a plain buffer: std::vector does not
  // align __m512 to 64 bytes)
  std::vector<float> mxb(B * TILE);
  std::vector<__mmask16> nan(B);
  for (int64_t k = k0; k < k1; ++k) {
    std::fill(mxb.begin(), mxb.end(), -std::numeric_limits<float>::infinity());
    std::fill(nan.begin(), nan.end(), (__mmask16)0);
    const int64_t pe = (k + 1) * ppc < np ? (k + 1) * ppc : np;
    for (int64_t p = k * ppc; p < pe; ++p) {
      const int8_t* w = packed + p * groups * 128;
      for (int64_t bt = 0; bt < nbt; ++bt) {
        const uint8_t* a = codes + bt * MT * rowb;
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t kb = 0; kb < nkb; ++kb) {
          if (pf > 0 && bt == 0)  // (the 2 KiB of weight this step reads, pf bytes ahead: once a panel)
            for (int64_t l = 0; l < 2 * TILE; ++l)
              _mm_prefetch(reinterpret_cast<const char*>(w + kb * 16 * 128 + pf + l * 64), _MM_HINT_T0);
          _tile_loadd(2, a + kb * 64, rowb);
          _tile_loadd(3, w + kb * 16 * 128, 128);
          _tile_loadd(4, w + kb * 16 * 128 + 64, 128);
          _tile_dpbusd(0, 2, 3);
          _tile_dpbusd(1, 2, 4);
        }
        _tile_stored(0, buf[0], TILE * sizeof(int32_t));
        _tile_stored(1, buf[1], TILE * sizeof(int32_t));
        const int64_t nb = B - bt * MT < MT ? B - bt * MT : MT;
        for (int64_t i = 0; i < nb; ++i) {
          const int64_t b = bt * MT + i;
          __m512i acc0 = _mm512_load_si512(buf[0][i]), acc1 = _mm512_load_si512(buf[1][i]);
          for (int64_t g = nkb * 16; g < groups; ++g) {  // the groups past the last whole 16
            const __m512i av = _mm512_set1_epi32(codes32[b * groups + g]);
            acc0 = _mm512_dpbusd_epi32(acc0, av, _mm512_loadu_si512(w + g * 128));
            acc1 = _mm512_dpbusd_epi32(acc1, av, _mm512_loadu_si512(w + g * 128 + 64));
          }
          __m512 mx = _mm512_loadu_ps(mxb.data() + b * TILE);
          store_tile<1>(&acc0, zsum, sv, c, y + b * V, V, p * PANEL, &mx, &nan[b]);
          store_tile<1>(&acc1, zsum, sv, c, y + b * V, V, p * PANEL + TILE, &mx, &nan[b]);
          _mm512_storeu_ps(mxb.data() + b * TILE, mx);
        }
      }
    }
    if (bmax != nullptr)
      for (int64_t b = 0; b < B; ++b)
        bmax[b * nblk + k] = nan[b] ? std::numeric_limits<float>::quiet_NaN()
                                    : _mm512_reduce_max_ps(_mm512_loadu_ps(mxb.data() + b * TILE));
  }
  _tile_release();
}

}  // namespace

bool int8_vnni_supported() { return cpu_has_vnni(); }
bool int8_avx2_supported() { return cpu_has_avx2_fma(); }  // (int8_avx2.cpp: where no VNNI)

// q [V, d] int8 -> [ceil(V / 32), ceil(d / 4), 2, 16, 4] int8, zero padded: panel p, group g,
// tile j, lane l holds q[32 p + 16 j + l, 4 g .. 4 g + 3].
at::Tensor pack_int8_vnni(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.device().is_cpu(), "q: [V, d] int8 CPU");
  const auto qc = q.contiguous();
  const int64_t V = qc.size(0), d = qc.size(1);
  const int64_t np = (V + PANEL - 1) / PANEL, groups = (d + GROUP - 1) / GROUP;
  auto out = at::zeros({np, groups, PANEL / TILE, TILE, GROUP}, qc.options());
  const int8_t* src = qc.data_ptr<int8_t>();
  int8_t* dst = out.data_ptr<int8_t>();
  at::parallel_for(0, np, 16, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t r = 0; r < PANEL && p * PANEL + r < V; ++r) {
        const int8_t* row = src + (p * PANEL + r) * d;
        for (int64_t k = 0; k < d; ++k) dst[((p * groups + k / GROUP) * PANEL + r) * GROUP + k % GROUP] = row[k];
      }
  });
  return out;
}

// The codes p + 64 of x = [c p_b, -64 c, 63 c] ([B, d + 2] fp32, c a power of two shared by the
// rows), zero padded to 4 * groups columns; refuses any other input (the no-saturation
// condition is checked on every call).
at::Tensor act7_codes(const at::Tensor& x, int64_t d, int64_t groups, float* c_out) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == d + 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x: [B, d + 2] float32, contiguous");
  const int64_t B = x.size(0);
  auto codes = at::empty({B, groups * GROUP}, x.options().dtype(at::kByte));  // (not at::zeros: its
  // dispatch runs cold after the previous step's GEMM; the padding is zeroed below)
  if (B == 0) return codes;
  const float* xp = x.data_ptr<float>();
  const float c = xp[d + 1] / (float)CSV_ACT_MAX;  // exact: 63 c / 63
  int e = 0;
  TORCH_CHECK(std::isfinite(c) && c > 0.f && std::frexp(c, &e) == 0.5f && std::fpclassify(c) == FP_NORMAL,
              "int8_vnni_linear: the scale c is not a normal power of two");
  const float inv = 1.f / c;  // exact: a power of two
  uint8_t* out = codes.data_ptr<uint8_t>();
  bool ok = true;
  for (int64_t b = 0; b < B; ++b) {
    const float* r = xp + b * (d + 2);
    ok = ok && r[d] == (float)CSV_ACT_MIN * c && r[d + 1] == (float)CSV_ACT_MAX * c;
    for (int64_t k = 0; k < d; ++k) {
      const float v = r[k] * inv;
      ok = ok && v >= (float)CSV_ACT_MIN && v <= (float)CSV_ACT_MAX && v == std::nearbyint(v);
      out[b * groups * GROUP + k] = ok ? (uint8_t)((int)v - CSV_ACT_MIN) : 0;
    }
    for (int64_t k = d; k < groups * GROUP; ++k) out[b * groups * GROUP + k] = 0;  // zero codes x zero weights
  }
  TORCH_CHECK(ok, "int8_vnni_linear: input is not c times 7-bit integers (the screen's layout)");
  *c_out = c;
  return codes;
}

// y [B, V] fp32 = fl(fl(sum_k (code[b, k] - 64) q[i, k]) * fl(c s_i)) for x = [c p_b, -64 c, 63 c]
// ([B, d + 2] fp32; q [V, d] packed by pack_int8_vnni), and with block > 0 (a multiple of 32) the
// maxima of y over consecutive blocks of that many tokens, [B, ceil(V / block)] (else [B, 0]).
// zsum [32 * panels] int32 = 64 * rowsum(q); s [32 * panels] fp32 (both zero past V).
bool int8_amx_supported() { return cpu_has_amx(); }

enum class Kernel { BEST, AVX2, AMX };  // BEST: VNNI where the CPU has it, else AVX2

// int8_vnni_linear's body, on the kernel asked for (the same result on each).
std::tuple<at::Tensor, at::Tensor> int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& zsum,
                                               const at::Tensor& s, int64_t V, int64_t d, int64_t block,
                                               Kernel kernel) {
  const bool avx2 = kernel == Kernel::AVX2 || (kernel == Kernel::BEST && !cpu_has_vnni());
  TORCH_CHECK(avx2 || cpu_has_vnni(), "int8_vnni_linear needs AVX512-VNNI");
  TORCH_CHECK(!avx2 || cpu_has_avx2_fma(), "int8_vnni_linear needs AVX512-VNNI or AVX2 and FMA");
  TORCH_CHECK(kernel != Kernel::AMX || cpu_has_amx(),
              "int8_amx_linear needs AMX-INT8 (and the kernel's permission to use it)");
  TORCH_CHECK(packed.dim() == 5 && packed.size(2) == PANEL / TILE && packed.size(3) == TILE &&
                  packed.size(4) == GROUP && packed.is_contiguous() && packed.scalar_type() == at::kChar,
              "packed: pack_int8_vnni's layout");
  const int64_t np = packed.size(0), groups = packed.size(1);
  TORCH_CHECK(V > (np - 1) * PANEL && V <= np * PANEL, "V does not match the packed weight");
  TORCH_CHECK(zsum.scalar_type() == at::kInt && zsum.numel() == np * PANEL && zsum.is_contiguous(), "zsum");
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.numel() == np * PANEL && s.is_contiguous(), "s");
  TORCH_CHECK(d > GROUP * (groups - 1) && d <= GROUP * groups, "d does not match the packed weight");
  TORCH_CHECK(block >= 0 && block % PANEL == 0, "block: 0 or a multiple of 32");
  float c = 1.f;
  const auto codes = act7_codes(x, d, groups, &c);
  const int64_t B = x.size(0);
  const int64_t ppc = block > 0 ? block / PANEL : 8;  // panels a chunk (a block when block > 0)
  const int64_t nchunk = (np + ppc - 1) / ppc;
  auto y = at::empty({B, V}, s.options());
  auto bmax = at::empty({B, block > 0 ? nchunk : 0}, s.options());
  if (B == 0) return {y, bmax};
  const int8_t* w = packed.data_ptr<int8_t>();
  const int32_t* z = zsum.data_ptr<int32_t>();
  const float* sc = s.data_ptr<float>();
  const uint32_t* cp = reinterpret_cast<const uint32_t*>(codes.data_ptr<uint8_t>());
  float* out = y.data_ptr<float>();
  float* bm = block > 0 ? bmax.data_ptr<float>() : nullptr;
  const int64_t pf = prefetch_ahead();
  // Chunks split over the threads; each thread streams its panels once per batch tile of BT
  // rows (one pass at decode batches, B <= 8).
  if (kernel == Kernel::AMX) {
    // A tiles read 16 rows of codes: the batch padded to a multiple of 16 with zero codes
    const int64_t rows = (B + MT - 1) / MT * MT;
    auto padded = at::zeros({rows, groups * GROUP}, codes.options());
    padded.narrow(0, 0, B).copy_(codes);
    const uint8_t* pc = padded.data_ptr<uint8_t>();
    at::parallel_for(0, nchunk, 1, [&](int64_t k0, int64_t k1) {
      panels_amx(w, z, sc, c, pc, out, B, groups, V, np, ppc, k0, k1, bm, nchunk, pf);
    });
    return {y, bmax};
  }
  if (avx2) {
    at::parallel_for(0, nchunk, 1, [&](int64_t k0, int64_t k1) {
      int8_avx2_chunks(w, z, sc, c, cp, out, B, groups, V, np, ppc, k0, k1, bm, nchunk, pf);
    });
    return {y, bmax};
  }
  at::parallel_for(0, nchunk, 1, [&](int64_t k0, int64_t k1) {
    for (int64_t b0 = 0; b0 < B; b0 += BT) {
      const int64_t nb = B - b0 < BT ? B - b0 : BT;
      PANEL_FNS[nb - 1](w, z, sc, c, cp + b0 * groups, out + b0 * V, groups, V, np, ppc, k0, k1,
                        bm == nullptr ? nullptr : bm + b0 * nchunk, nchunk, pf);
    }
  });
  return {y, bmax};
}

std::tuple<at::Tensor, at::Tensor> int8_vnni_linear(const at::Tensor& x, const at::Tensor& packed,
                                                    const at::Tensor& zsum, const at::Tensor& s, int64_t V,
                                                    int64_t d, int64_t block) {
  return int8_linear(x, packed, zsum, s, V, d, block, Kernel::BEST);
}

// int8_vnni_linear on the AVX2 kernel whatever the CPU has (tests, benchmarks): the same result.
std::tuple<at::Tensor, at::Tensor> int8_avx2_linear(const at::Tensor& x, const at::Tensor& packed,
                                                    const at::Tensor& zsum, const at::Tensor& s, int64_t V,
                                                    int64_t d, int64_t block) {
  return int8_linear(x, packed, zsum, s, V, d, block, Kernel::AVX2);
}

// int8_vnni_linear with AMX tiles: the same arguments and, bit for bit, the same result.
std::tuple<at::Tensor, at::Tensor> int8_amx_linear(const at::Tensor& x, const at::Tensor& packed,
                                                   const at::Tensor& zsum, const at::Tensor& s, int64_t V,
                                                   int64_t d, int64_t block) {
  return int8_linear(x, packed, zsum, s, V, d, block, Kernel::AMX);
}

TORCH_LIBRARY_FRAGMENT(vllm_csv_cpu, m) {
  m.def("int8_vnni_supported() -> bool");
  m.def("int8_amx_supported() -> bool");
  m.def("int8_avx2_supported() -> bool");
  m.def("int8_avx2_linear(Tensor x, Tensor packed, Tensor zsum, Tensor s, int V, int d, int block) -> (Tensor, Tensor)");
  m.def("set_prefetch_ahead(int bytes) -> int");
  m.def("int8_amx_linear(Tensor x, Tensor packed, Tensor zsum, Tensor s, int V, int d, int block) -> (Tensor, Tensor)");
  m.def("pack_int8_vnni(Tensor q) -> Tensor");
  m.def("int8_vnni_linear(Tensor x, Tensor packed, Tensor zsum, Tensor s, int V, int d, int block) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(vllm_csv_cpu, CPU, m) {
  m.impl("pack_int8_vnni", &pack_int8_vnni);
  m.impl("int8_vnni_linear", &int8_vnni_linear);
  m.impl("int8_amx_linear", &int8_amx_linear);
  m.impl("int8_avx2_linear", &int8_avx2_linear);
}

TORCH_LIBRARY_IMPL(vllm_csv_cpu, CompositeExplicitAutograd, m) {
  m.impl("int8_vnni_supported", &int8_vnni_supported);
  m.impl("int8_amx_supported", &int8_amx_supported);
  m.impl("int8_avx2_supported", &int8_avx2_supported);
  m.impl("set_prefetch_ahead", &set_prefetch_ahead);
}
