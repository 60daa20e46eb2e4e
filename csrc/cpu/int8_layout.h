// The int8 screen's packed weight layout, shared by its kernels (int8_vnni.cpp: AVX512-VNNI and
// AMX; int8_avx2.cpp: AVX2), and the AVX2 kernel's entry point.
//
// pack_int8_vnni: rows in tiles of TILE = 16, k in groups of GROUP = 4; a tile of one group is
// one 64-byte vector [16 rows][4 k]; two tiles make a panel of PANEL = 32 rows, interleaved
// group by group (128 bytes a group), and panels follow each other. Rows past V and k past d are
// zero.
#pragma once

#include <cstdint>

namespace csv_int8 {

constexpr int64_t TILE = 16;          // rows a tile (int32 lanes of a zmm; two ymm halves)
constexpr int64_t GROUP = CSV_GROUP;  // k a group (bytes vpdpbusd sums into one lane): vllm_csv.ops.build
constexpr int64_t PANEL = CSV_PANEL;  // rows a panel (two tiles, interleaved by group): vllm_csv.ops.build
static_assert(GROUP == 4 && PANEL == 2 * TILE, "the layout vpdpbusd and the two-tile panel loops need");

}  // namespace csv_int8

// AVX2 and FMA usable (cpuid, capped by VLLM_CSV_CPU_ISA): int8_avx2.cpp.
bool cpu_has_avx2_fma();

// The AVX2 kernel (int8_avx2.cpp) over chunks k0 .. k1 of ppc panels, every batch row (B rows
// of codes, uint32 groups): y [B, V] and, with bmax not null, each chunk's maximum per batch row
// bmax[b, k] (NaN where the chunk holds one): the same bits as the VNNI kernel's panels<NB>.
void int8_avx2_chunks(const int8_t* packed, const int32_t* zsum, const float* sv, float c, const uint32_t* codes,
                      float* y, int64_t B, int64_t groups, int64_t V, int64_t np, int64_t ppc, int64_t k0,
                      int64_t k1, float* bmax, int64_t nblk, int64_t pf);
