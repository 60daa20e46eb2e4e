// int8 screen: y[b, i] = s_i * sum_j q[i, j] * h[b, j] (+ bias_i), fp32 accumulation.
//
// The LM head W [V, d] is stored as int8 rows q_i with one fp32 scale s_i (W ~ s q).
// Memory-bound skinny GEMM: each warp owns one row i, reads q_i once with 16-byte loads
// and accumulates all B <= MAX_B hidden states, so W is read once per step for the whole
// batch. Torch-free: the binding (ops.cpp) is compiled only by the torch extension build.
#pragma once
#include <cstdint>

namespace vllm_csv {

constexpr int kMaxBatch = 64;  // rows of h per launch; larger batches are split by the caller

// h: [B, d] fp32 (row-major), q: [V, d] int8, scale: [V], bias: [V] or nullptr, y: [B, V] fp32.
void launch_int8_screen(const float* h, const int8_t* q, const float* scale, const float* bias, float* y,
                        int B, int V, int d, void* stream);

}  // namespace vllm_csv
