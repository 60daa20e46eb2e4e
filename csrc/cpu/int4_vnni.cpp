// The int4 screen's GEMM with AVX512-VNNI (vpdpbusd), else AVX2: half the bytes of the int8 copy.
//
// Computes (vllm_csv/ops/int4_vnni.py has the torch reference, bit for bit):
//
//   y[b, i] = fl(z[b, i] * c),  z[b, i] = fl(... fl(fl(s[i, 0] A[b, i, 0]) + s[i, 1] A[b, i, 1]) ...)
//   A[b, i, g] = sum_{k in group g} p[b, k] q[i, k]          (groups of 32 columns, in order)
//
// with int4 weights q in [-7, 7] (stored as the nibble q + 8), fp16 group scales s (normal
// numbers), 7-bit signed activations p in [-64, 63] given as x = [c p_b, -64 c, 63 c] (c a power
// of two, read from the last column), and every step of z one fused multiply-add (one rounding).
// vpdpbusd multiplies the unsigned nibbles by the signed activation bytes and adds groups of four
// into int32 lanes without saturation: per group, sum (q + 8) p <= 15 * 64 * 32 < 2^31, so
// A = sum (q + 8) p - 8 sum p is exact in int32, and exact in fp32 (|A| < 2^24) after cvtdq2ps.
//
// Weight layout (pack_int4_vnni): rows in panels of 32 (two tiles of 16: a zmm's int32 lanes), k
// in subgroups of 4; a panel's subgroup is one 64-byte vector whose byte 4 l + j holds, in its low
// nibble, q[32 p + l, 4 m + j] + 8 and in its high nibble q[32 p + 16 + l, 4 m + j] + 8 (tile 0
// and tile 1 of vpdpbusd's operand, after a mask and a shift). Scales: [panel][group][32] fp16.
// Rows past V and k past d hold q = 0 (nibble 8) and scale 0.
//
// Where the CPU has no AVX512-VNNI but AVX2, FMA and F16C (AMD Zen 2/3, Intel Haswell to
// Skylake-SP; or VLLM_CSV_CPU_ISA=avx2), panels4_avx2 computes the same bits on the same layout:
// each 64-byte vector as two ymm halves (rows 0-7 | 16-23 in bytes 0-31, rows 8-15 | 24-31 in
// 32-63), nibbles unpacked with an and and a shift, vpmaddubsw of the unsigned nibbles by the
// signed activation bytes into int16 pairs (at most 2 * 15 * 64 = 1920 in magnitude), summed in
// int16 over the group's 8 subgroups (at most 15360 < 2^15: exact), vpmaddwd by ones into the
// int32 group sum A, then the same cvtdq2ps and fused multiply-add as above.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "isa.h"

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

int64_t prefetch_ahead();  // bytes ahead of the weight stream to prefetch (int8_vnni.cpp)

namespace {

constexpr int64_t TILE = 16;   // rows a tile (int32 lanes of a zmm)
constexpr int64_t PANEL = 32;  // rows a panel (two tiles, one nibble each)
constexpr int64_t SUB = 4;     // k a vpdpbusd lane sums
constexpr int64_t QG = 32;     // k a scale group
constexpr int64_t SPG = QG / SUB;  // subgroups a scale group
constexpr int64_t BT = 8;      // batch rows a pass keeps

bool cpu_has_vnni4() {
  __builtin_cpu_init();
  return CSV_CPU_SUPPORTS("avx512f") && CSV_CPU_SUPPORTS("avx512bw") &&
         CSV_CPU_SUPPORTS("avx512vnni") && CSV_CPU_SUPPORTS("f16c");
}

// Panels p0 .. p1 for NB batch rows. codes [NB][G * 8] int32 (four signed activation bytes each),
// p8 [NB][G] int32 = 8 * sum of the group's activations. Both tiles of a panel at once (one load
// feeds both; taking them one after the other from L1 measured slower: 6.6 against 5.3 ms at
// 151936 x 1024, 8 rows, 2 threads). At 8 rows the kernel is bound by vpdpbusd, as the int8
// kernel is (the same count of them), plus the per-group rescaling: it is faster than the int8
// kernel at small batches only (2.5 against 4.6 ms at 1 row there), where it reads half the bytes.
template <int NB>
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c"))) void panels4(
    const uint8_t* packed, const uint16_t* scales, const int32_t* codes, const int32_t* p8, float c, float* y,
    int64_t G, int64_t V, int64_t p0, int64_t p1, int64_t pf) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512 cv = _mm512_set1_ps(c);
  for (int64_t p = p0; p < p1; ++p) {
    __m512 z0[NB], z1[NB];
    for (int b = 0; b < NB; ++b) z0[b] = z1[b] = _mm512_setzero_ps();
    const uint8_t* w = packed + p * G * SPG * 64;
    const uint16_t* sp = scales + p * G * PANEL;
    for (int64_t g = 0; g < G; ++g) {
      __m512i a0[NB], a1[NB];
      for (int b = 0; b < NB; ++b) a0[b] = a1[b] = _mm512_setzero_si512();
      for (int64_t m = 0; m < SPG; ++m) {
        if (pf > 0) _mm_prefetch(reinterpret_cast<const char*>(w + (g * SPG + m) * 64 + pf), _MM_HINT_T0);
        const __m512i v = _mm512_loadu_si512(w + (g * SPG + m) * 64);
        const __m512i x0 = _mm512_and_si512(v, low);
        const __m512i x1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        for (int b = 0; b < NB; ++b) {
          const __m512i act = _mm512_set1_epi32(codes[b * G * SPG + g * SPG + m]);
          a0[b] = _mm512_dpbusd_epi32(a0[b], x0, act);
          a1[b] = _mm512_dpbusd_epi32(a1[b], x1, act);
        }
      }
      const __m512 s0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp + g * PANEL)));
      const __m512 s1 =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp + g * PANEL + TILE)));
      for (int b = 0; b < NB; ++b) {
        const __m512i off = _mm512_set1_epi32(p8[b * G + g]);
        z0[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a0[b], off)), s0, z0[b]);
        z1[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a1[b], off)), s1, z1[b]);
      }
    }
    for (int t = 0; t < 2; ++t) {
      const int64_t r0 = p * PANEL + t * TILE;
      if (r0 >= V) break;
      const int64_t n = V - r0 < TILE ? V - r0 : TILE;
      const __mmask16 mk = n == TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
      for (int b = 0; b < NB; ++b)
        _mm512_mask_storeu_ps(y + b * V + r0, mk, _mm512_mul_ps(t == 0 ? z0[b] : z1[b], cv));
    }
  }
}

bool cpu_has_avx2_f16c() {
  __builtin_cpu_init();
  return CSV_CPU_SUPPORTS("avx2") && CSV_CPU_SUPPORTS("fma") && CSV_CPU_SUPPORTS("f16c");
}

// panels4 with AVX2 (the top of the file). Per batch row four int16 and four fp32 accumulators
// of 8 rows each (the panel's 32 rows); one pass over the panel for NB rows.
template <int NB>
__attribute__((target("avx2,fma,f16c"))) void panels4_avx2(
    const uint8_t* packed, const uint16_t* scales, const int32_t* codes, const int32_t* p8, float c, float* y,
    int64_t G, int64_t V, int64_t p0, int64_t p1, int64_t pf) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256 cv = _mm256_set1_ps(c);
  for (int64_t p = p0; p < p1; ++p) {
    __m256 z[NB][4];
    for (int b = 0; b < NB; ++b)
      for (int j = 0; j < 4; ++j) z[b][j] = _mm256_setzero_ps();
    const uint8_t* w = packed + p * G * SPG * 64;
    const uint16_t* sp = scales + p * G * PANEL;
    for (int64_t g = 0; g < G; ++g) {
      __m256i a[NB][4];  // int16 pair sums, rows 8 j .. 8 j + 7
      for (int b = 0; b < NB; ++b)
        for (int j = 0; j < 4; ++j) a[b][j] = _mm256_setzero_si256();
      for (int64_t m = 0; m < SPG; ++m) {
        const uint8_t* v = w + (g * SPG + m) * 64;
        if (pf > 0) _mm_prefetch(reinterpret_cast<const char*>(v + pf), _MM_HINT_T0);
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 32));
        const __m256i x[4] = {_mm256_and_si256(v0, low), _mm256_and_si256(v1, low),
                              _mm256_and_si256(_mm256_srli_epi16(v0, 4), low),
                              _mm256_and_si256(_mm256_srli_epi16(v1, 4), low)};
        for (int b = 0; b < NB; ++b) {
          const __m256i act = _mm256_set1_epi32(codes[b * G * SPG + g * SPG + m]);
          for (int j = 0; j < 4; ++j) a[b][j] = _mm256_add_epi16(a[b][j], _mm256_maddubs_epi16(x[j], act));
        }
      }
      for (int j = 0; j < 4; ++j) {
        const __m256 sj = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + g * PANEL + 8 * j)));
        for (int b = 0; b < NB; ++b) {
          const __m256i A = _mm256_sub_epi32(_mm256_madd_epi16(a[b][j], ones), _mm256_set1_epi32(p8[b * G + g]));
          z[b][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(A), sj, z[b][j]);
        }
      }
    }
    for (int j = 0; j < 4; ++j) {
      const int64_t r0 = p * PANEL + 8 * j;
      if (r0 >= V) continue;
      const int64_t n = V - r0 < 8 ? V - r0 : 8;
      const __m256i mk = _mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      for (int b = 0; b < NB; ++b) _mm256_maskstore_ps(y + b * V + r0, mk, _mm256_mul_ps(z[b][j], cv));
    }
  }
}

constexpr int64_t BT2 = 2;  // batch rows a pass keeps, AVX2 (8 ymm accumulators each)

using Panel4Fn = void (*)(const uint8_t*, const uint16_t*, const int32_t*, const int32_t*, float, float*, int64_t,
                          int64_t, int64_t, int64_t, int64_t);
const Panel4Fn PANEL4_FNS[BT] = {panels4<1>, panels4<2>, panels4<3>, panels4<4>,
                                 panels4<5>, panels4<6>, panels4<7>, panels4<8>};
const Panel4Fn PANEL4_AVX2_FNS[BT2] = {panels4_avx2<1>, panels4_avx2<2>};

}  // namespace

bool int4_vnni_supported() { return cpu_has_vnni4(); }
bool int4_avx2_supported() { return cpu_has_avx2_f16c(); }

// q [V, d] int8 in [-7, 7] -> [ceil(V / 32), ceil(d / 32) * 8, 64] uint8 (the layout above).
at::Tensor pack_int4_vnni(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.device().is_cpu(), "q: [V, d] int8 CPU");
  const auto qc = q.contiguous();
  const int64_t V = qc.size(0), d = qc.size(1);
  const int64_t np = (V + PANEL - 1) / PANEL, G = (d + QG - 1) / QG;
  TORCH_CHECK(qc.numel() == 0 || (qc.min().item<int8_t>() >= -7 && qc.max().item<int8_t>() <= 7), "q: in [-7, 7]");
  auto out = at::full({np, G * SPG, 64}, 0x88, qc.options().dtype(at::kByte));
  const int8_t* src = qc.data_ptr<int8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, np, 16, [&](int64_t a, int64_t e) {
    for (int64_t p = a; p < e; ++p)
      for (int64_t r = 0; r < PANEL && p * PANEL + r < V; ++r) {
        const int8_t* row = src + (p * PANEL + r) * d;
        const int lane = (int)(r % TILE), hi = (int)(r / TILE);
        for (int64_t k = 0; k < d; ++k) {
          uint8_t& byte = dst[(p * G * SPG + k / SUB) * 64 + lane * SUB + k % SUB];
          const uint8_t nib = (uint8_t)(row[k] + 8);
          byte = hi ? (uint8_t)((byte & 0x0F) | (nib << 4)) : (uint8_t)((byte & 0xF0) | nib);
        }
      }
  });
  return out;
}

// y [B, V] fp32 (the formula above) for x = [c p_b, -64 c, 63 c] ([B, d + 2] fp32); packed by
// pack_int4_vnni, scales [panels, G, 32] fp16 (as int16 bits). Refuses any other input: the
// no-overflow condition is checked on every call.
// avx2: the AVX2 kernel (else VNNI where the CPU has it, else AVX2).
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t V,
                       int64_t d, bool avx2) {
  avx2 = avx2 || !cpu_has_vnni4();
  TORCH_CHECK(!avx2 || cpu_has_avx2_f16c(), "int4_vnni_linear needs AVX512-VNNI or AVX2, FMA and F16C");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 64 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kByte, "packed: pack_int4_vnni's layout");
  const int64_t np = packed.size(0), G = packed.size(1) / SPG;
  TORCH_CHECK(packed.size(1) == G * SPG && V > (np - 1) * PANEL && V <= np * PANEL, "V does not match packed");
  TORCH_CHECK(d > QG * (G - 1) && d <= QG * G, "d does not match packed");
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == np && scales.size(1) == G && scales.size(2) == PANEL &&
                  scales.is_contiguous() && scales.scalar_type() == at::kShort, "scales: [panels, G, 32] int16");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == d + 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x: [B, d + 2] float32, contiguous");
  const int64_t B = x.size(0);
  auto y = at::empty({B, V}, x.options());
  if (B == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float c = xp[d + 1] / 63.f;  // exact: 63 c / 63
  int ex = 0;
  TORCH_CHECK(std::isfinite(c) && c > 0.f && std::frexp(c, &ex) == 0.5f && std::fpclassify(c) == FP_NORMAL,
              "int4_vnni_linear: the scale c is not a normal power of two");
  const float inv = 1.f / c;
  auto codes = at::zeros({B, G * QG}, x.options().dtype(at::kChar));
  auto p8 = at::zeros({B, G}, x.options().dtype(at::kInt));
  int8_t* cd = codes.data_ptr<int8_t>();
  int32_t* ps = p8.data_ptr<int32_t>();
  bool ok = true;
  for (int64_t b = 0; b < B; ++b) {
    const float* r = xp + b * (d + 2);
    ok = ok && r[d] == -64.f * c && r[d + 1] == 63.f * c;
    for (int64_t k = 0; k < d; ++k) {
      const float v = r[k] * inv;
      ok = ok && v >= -64.f && v <= 63.f && v == std::nearbyint(v);
      const int iv = ok ? (int)v : 0;
      cd[b * G * QG + k] = (int8_t)iv;
      ps[b * G + k / QG] += 8 * iv;
    }
  }
  TORCH_CHECK(ok, "int4_vnni_linear: input is not c times 7-bit integers (the screen's layout)");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>());
  const int32_t* cw = reinterpret_cast<const int32_t*>(cd);
  float* out = y.data_ptr<float>();
  const int64_t pf = prefetch_ahead();
  const int64_t bt = avx2 ? BT2 : BT;
  const Panel4Fn* fns = avx2 ? PANEL4_AVX2_FNS : PANEL4_FNS;
  at::parallel_for(0, np, 8, [&](int64_t a, int64_t e) {
    for (int64_t b0 = 0; b0 < B; b0 += bt) {
      const int64_t nb = B - b0 < bt ? B - b0 : bt;
      fns[nb - 1](w, sc, cw + b0 * G * SPG, ps + b0 * G, c, out + b0 * V, G, V, a, e, pf);
    }
  });
  return y;
}

at::Tensor int4_vnni_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t V,
                            int64_t d) {
  return int4_linear(x, packed, scales, V, d, false);
}

// int4_vnni_linear on the AVX2 kernel whatever the CPU has (tests, benchmarks): the same result.
at::Tensor int4_avx2_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t V,
                            int64_t d) {
  return int4_linear(x, packed, scales, V, d, true);
}

TORCH_LIBRARY_FRAGMENT(vllm_csv_cpu, m) {
  m.def("int4_vnni_supported() -> bool");
  m.def("int4_avx2_supported() -> bool");
  m.def("int4_avx2_linear(Tensor x, Tensor packed, Tensor scales, int V, int d) -> Tensor");
  m.def("pack_int4_vnni(Tensor q) -> Tensor");
  m.def("int4_vnni_linear(Tensor x, Tensor packed, Tensor scales, int V, int d) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_csv_cpu, CPU, m) {
  m.impl("pack_int4_vnni", &pack_int4_vnni);
  m.impl("int4_vnni_linear", &int4_vnni_linear);
  m.impl("int4_avx2_linear", &int4_avx2_linear);
}

TORCH_LIBRARY_IMPL(vllm_csv_cpu, CompositeExplicitAutograd, m) {
  m.impl("int4_vnni_supported", &int4_vnni_supported);
  m.impl("int4_avx2_supported", &int4_avx2_supported);
}
