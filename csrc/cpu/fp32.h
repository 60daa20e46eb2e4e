// fp32 and float64 helpers of the certified step's kernels (csv_cpu.cpp, select_cpu.cpp,
// rows_cpu.cpp), each the twin of its Python reference: the same roundings, bit for bit.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

namespace csv_fp32 {

inline constexpr float INF32 = std::numeric_limits<float>::infinity();
inline constexpr float NAN32 = std::numeric_limits<float>::quiet_NaN();

inline float round_up32(double x) {  // vllm_csv.fp.round_up32
  float f = static_cast<float>(x);
  return static_cast<double>(f) < x ? std::nextafter(f, INF32) : f;
}

inline float round_down32(double x) {  // vllm_csv.fp.round_down32
  float f = static_cast<float>(x);
  return static_cast<double>(f) > x ? std::nextafter(f, -INF32) : f;
}

// p[j] (a model-dtype or fp32 value) in float64, exactly (through fp32, as torch widens it).
template <typename T>
inline double at64(const T* p, int64_t j) {
  return static_cast<double>(static_cast<float>(p[j]));
}

}  // namespace csv_fp32
