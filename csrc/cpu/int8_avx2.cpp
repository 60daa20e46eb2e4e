// The int8 screen's GEMM with AVX2 (vpmaddubsw, vpmaddwd), for CPUs without AVX512-VNNI (AMD
// Zen 2/3, Intel Haswell to Skylake-SP): the same sums over the same packed weight
// (int8_layout.h) as the VNNI kernel (int8_vnni.cpp), and the same y and block maxima, bit for
// bit.
//
// Each 64-byte tile vector of the layout is two ymm halves (rows 0-7, rows 8-15), each row's
// group of four k one int32 lane. vpmaddubsw multiplies the broadcast unsigned codes (p + 64 in
// [0, 127]) by the signed weights and adds adjacent pairs into int16 with signed saturation;
// a pair is at most 2 * 127 * 128 = 32512 < 2^15 in magnitude (codes <= 127, |q| <= 128), so it
// never saturates and every int16 is exact. vpmaddwd by ones adds the two pairs of a lane into
// int32 (exact), vpaddd accumulates: the int32 sum over the group of four is vpdpbusd's, and the
// accumulator is exact for the same reason as there (|sum| <= 127 * 128 * d < 2^31). The rescale
// is the VNNI kernel's store_tile: fl(fl(acc - 64 rowsum) * fl(c s_i)) (vcvtdq2ps, vmulps, round
// to nearest even), rows past V neither stored nor in the maxima, a NaN in a block making its
// maximum NaN.

#include <immintrin.h>

#include "int8_layout.h"
#include "isa.h"

#include <cstdint>
#include <limits>

using csv_int8::PANEL;
using csv_int8::TILE;

bool cpu_has_avx2_fma() {
  __builtin_cpu_init();
  return CSV_CPU_SUPPORTS("avx2") && CSV_CPU_SUPPORTS("fma");
}

namespace {

// Batch rows a pass over a panel serves (4 ymm accumulators each): up to BT = 4 rows in one pass
// (16 accumulators, most spilled to L1, but the weight streams from memory once, which is what
// bounds batches this small), more rows in tiles of BT_BIG = 2 (8 accumulators in registers: no
// spill), each tile re-reading the chunk from L2. Measured under VLLM_CSV_CPU_ISA=avx2 on a Zen 4
// core (benchmarks/README.md, "The int8 screen's AVX2 kernel"): tiles of 4 were 6-8% slower than
// tiles of 2 at 8 and 16 rows, tiles of 2 slower than one pass at 3 and 4 rows.
constexpr int BT = 4, BT_BIG = 2;

// One panel (32 rows: four ymm of 8 rows a group) for NB batch rows: acc[b][j] = sum_k code[b, k]
// q[row, k], j = 2 * tile + half. One sequential stream of 128 bytes a group, prefetched pf bytes
// ahead (as in the VNNI kernel; a prefetch past the weight's end never faults).
template <int NB>
__attribute__((target("avx2,fma"))) inline void panel_dot(const int8_t* w, const uint32_t* codes, int64_t groups,
                                                          int64_t pf, __m256i (*acc)[4]) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int b = 0; b < NB; ++b)
    for (int j = 0; j < 4; ++j) acc[b][j] = _mm256_setzero_si256();
  for (int64_t g = 0; g < groups; ++g) {
    if (pf > 0) {
      _mm_prefetch(reinterpret_cast<const char*>(w + g * 128 + pf), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + g * 128 + 64 + pf), _MM_HINT_T0);
    }
    __m256i x[4];
    for (int j = 0; j < 4; ++j) x[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 128 + 32 * j));
    for (int b = 0; b < NB; ++b) {
      const __m256i a = _mm256_set1_epi32(static_cast<int32_t>(codes[b * groups + g]));
      for (int j = 0; j < 4; ++j)  // (pairs <= 32512: no saturation, see the top)
        acc[b][j] = _mm256_add_epi32(acc[b][j], _mm256_madd_epi16(_mm256_maddubs_epi16(a, x[j]), ones));
    }
  }
}

// y[b, rows r0 .. r0 + 15] from the tile's two halves acc[b][2 t], acc[b][2 t + 1]; the running
// maxima mx[b][half] and NaN flags nan[b] as the VNNI kernel's store_tile keeps them (vmaxps
// returns its second operand, v, when either is NaN; the flag keeps the NaN).
template <int NB>
__attribute__((target("avx2,fma"))) inline void store_tile(__m256i (*acc)[4], int t, const int32_t* zsum,
                                                           const float* sv, float c, float* y, int64_t V,
                                                           int64_t r0, __m256 (*mx)[2], int* nan) {
  if (r0 >= V) return;
  const int64_t n = V - r0 < TILE ? V - r0 : TILE;
  for (int h = 0; h < 2 && n > 8 * h; ++h) {
    const int64_t r = r0 + 8 * h, nh = n - 8 * h;
    const __m256i z = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(zsum + r));  // 64 * rowsum(q)
    const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(sv + r), _mm256_set1_ps(c));         // fl(c * s_i)
    if (nh >= 8) {
      for (int b = 0; b < NB; ++b) {
        const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[b][2 * t + h], z)), s);
        _mm256_storeu_ps(y + b * V + r, v);
        mx[b][h] = _mm256_max_ps(mx[b][h], v);
        nan[b] |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      }
    } else {  // the last rows of the head: lanes below nh only
      const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(nh)),
                                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      const __m256 mf = _mm256_castsi256_ps(m), ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
      for (int b = 0; b < NB; ++b) {
        const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[b][2 * t + h], z)), s);
        _mm256_maskstore_ps(y + b * V + r, m, v);
        mx[b][h] = _mm256_max_ps(mx[b][h], _mm256_blendv_ps(ninf, v, mf));
        nan[b] |= _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q), mf));
      }
    }
  }
}

// The largest of the 16 lanes of mx (no NaN among them: a NaN seen sets the flag instead).
__attribute__((target("avx2,fma"))) inline float reduce_max(const __m256* mx) {
  const __m256 m = _mm256_max_ps(mx[0], mx[1]);
  __m128 r = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  r = _mm_max_ps(r, _mm_movehl_ps(r, r));
  r = _mm_max_ss(r, _mm_shuffle_ps(r, r, 1));
  return _mm_cvtss_f32(r);
}

// The VNNI kernel's panels<NB> with the AVX2 panel loop.
template <int NB>
__attribute__((target("avx2,fma"))) void panels(const int8_t* packed, const int32_t* zsum, const float* sv,
                                                float c, const uint32_t* codes, float* y, int64_t groups,
                                                int64_t V, int64_t np, int64_t ppc, int64_t k0, int64_t k1,
                                                float* bmax, int64_t nblk, int64_t pf) {
  __m256i acc[NB][4];
  __m256 mx[NB][2];
  int nan[NB];
  for (int64_t k = k0; k < k1; ++k) {
    for (int b = 0; b < NB; ++b) {
      mx[b][0] = mx[b][1] = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
      nan[b] = 0;
    }
    const int64_t pe = (k + 1) * ppc < np ? (k + 1) * ppc : np;
    for (int64_t p = k * ppc; p < pe; ++p) {
      panel_dot<NB>(packed + p * groups * 128, codes, groups, pf, acc);
      store_tile<NB>(acc, 0, zsum, sv, c, y, V, p * PANEL, mx, nan);
      store_tile<NB>(acc, 1, zsum, sv, c, y, V, p * PANEL + TILE, mx, nan);
    }
    if (bmax != nullptr)
      for (int b = 0; b < NB; ++b)
        bmax[b * nblk + k] = nan[b] ? std::numeric_limits<float>::quiet_NaN() : reduce_max(mx[b]);
  }
}

using PanelFn = void (*)(const int8_t*, const int32_t*, const float*, float, const uint32_t*, float*, int64_t,
                         int64_t, int64_t, int64_t, int64_t, int64_t, float*, int64_t, int64_t);
const PanelFn PANEL_FNS[BT] = {panels<1>, panels<2>, panels<3>, panels<4>};

}  // namespace

// Chunk by chunk (a block, ppc panels: 256 KiB of weight at d = 1024, kept in L2 while every
// batch tile reads it), so that the weight streams from memory once at any batch.
void int8_avx2_chunks(const int8_t* packed, const int32_t* zsum, const float* sv, float c, const uint32_t* codes,
                      float* y, int64_t B, int64_t groups, int64_t V, int64_t np, int64_t ppc, int64_t k0,
                      int64_t k1, float* bmax, int64_t nblk, int64_t pf) {
  const int64_t bt = B <= BT ? BT : BT_BIG;
  for (int64_t k = k0; k < k1; ++k)
    for (int64_t b0 = 0; b0 < B; b0 += bt) {
      const int64_t nb = B - b0 < bt ? B - b0 : bt;
      PANEL_FNS[nb - 1](packed, zsum, sv, c, codes + b0 * groups, y + b0 * V, groups, V, np, ppc, k, k + 1,
                        bmax == nullptr ? nullptr : bmax + b0 * nblk, nblk, pf);
    }
}
