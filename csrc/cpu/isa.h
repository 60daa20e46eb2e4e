// What the kernels may use of this CPU: cpuid, capped by VLLM_CSV_CPU_ISA.
//
// Every kernel picks its vector path at run time (AVX-512, AVX2, scalar; AMX for the int8 GEMM's
// batches) by asking CSV_CPU_SUPPORTS instead of __builtin_cpu_supports. VLLM_CSV_CPU_ISA caps
// that answer, so that the AVX2 paths (and the Python choices that follow them: the int8 and int4
// GEMMs' AVX2 kernels, the reference of unlisted_masses) run, and are tested, on an AVX-512
// machine:
//
//   auto (or unset)  whatever the CPU has;
//   avx512           no AMX (the int8 GEMM's VNNI kernel at every batch);
//   avx2             no AVX-512 and no AMX: what an AVX2-only CPU (AMD Zen 2/3, older Xeons) runs.
//
// Any other value is auto (vllm_csv/ops/build.py warns). The variable is read once, when the
// library is loaded (csv_isa::loaded); cpu_isa_cap() (csv_cpu.cpp) tells Python which cap holds.
#pragma once

#include <strings.h>

#include <cstdlib>
#include <cstring>

namespace csv_isa {

enum Cap : int { AVX2 = 1, AVX512 = 2, AUTO = 3 };

inline int cap() {
  static const int c = [] {
    const char* v = std::getenv("VLLM_CSV_CPU_ISA");
    if (v == nullptr) return static_cast<int>(AUTO);
    if (strcasecmp(v, "avx2") == 0) return static_cast<int>(AVX2);
    if (strcasecmp(v, "avx512") == 0) return static_cast<int>(AVX512);
    return static_cast<int>(AUTO);
  }();
  return c;
}

// Whether the cap lets a kernel use `feature` (a __builtin_cpu_supports name, or "amx").
inline bool allows(const char* feature) {
  if (std::strncmp(feature, "avx512", 6) == 0) return cap() >= AVX512;
  if (std::strncmp(feature, "amx", 3) == 0) return cap() >= AUTO;
  return true;
}

inline const int loaded = cap();  // the variable read when the library loads, not at a later first call

}  // namespace csv_isa

#define CSV_CPU_SUPPORTS(feature) (csv_isa::allows(feature) && __builtin_cpu_supports(feature))
