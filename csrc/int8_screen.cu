#include "int8_screen.cuh"

#include <cuda_runtime.h>

namespace vllm_csv {
namespace {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 8;

template <int B>
__global__ void int8_screen_kernel(const float* __restrict__ h, const int8_t* __restrict__ q,
                                   const float* __restrict__ scale, const float* __restrict__ bias,
                                   float* __restrict__ y, int V, int d) {
  const int lane = threadIdx.x % kWarp;
  const int row = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp;
  if (row >= V) return;
  const int8_t* qr = q + static_cast<int64_t>(row) * d;
  float acc[B];
#pragma unroll
  for (int b = 0; b < B; ++b) acc[b] = 0.f;
  // Vectorised part: 16 int8 values per lane per iteration (needs 16-byte aligned rows).
  const bool aligned = (d % 16 == 0) && (reinterpret_cast<uintptr_t>(qr) % 16 == 0);
  int j0 = 0;
  if (aligned) {
    for (int j = lane * 16; j + 16 <= d; j += kWarp * 16) {
      const int4 packed = *reinterpret_cast<const int4*>(qr + j);
      const int8_t* v = reinterpret_cast<const int8_t*>(&packed);
#pragma unroll
      for (int t = 0; t < 16; ++t) {
        const float w = static_cast<float>(v[t]);
#pragma unroll
        for (int b = 0; b < B; ++b) acc[b] = fmaf(w, h[b * d + j + t], acc[b]);
      }
    }
    j0 = d;  // all columns handled (d % 16 == 0)
  }
  for (int j = j0 + lane; j < d; j += kWarp) {  // scalar tail / unaligned rows
    const float w = static_cast<float>(qr[j]);
#pragma unroll
    for (int b = 0; b < B; ++b) acc[b] = fmaf(w, h[b * d + j], acc[b]);
  }
#pragma unroll
  for (int b = 0; b < B; ++b) {
    float v = acc[b];
    for (int off = kWarp / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == 0) y[static_cast<int64_t>(b) * V + row] = v * scale[row] + (bias ? bias[row] : 0.f);
  }
}

template <int B>
void launch(const float* h, const int8_t* q, const float* s, const float* bias, float* y, int V, int d,
            cudaStream_t stream) {
  const dim3 grid((V + kWarpsPerBlock - 1) / kWarpsPerBlock), block(kWarpsPerBlock * kWarp);
  int8_screen_kernel<B><<<grid, block, 0, stream>>>(h, q, s, bias, y, V, d);
}

}  // namespace

void launch_int8_screen(const float* h, const int8_t* q, const float* scale, const float* bias, float* y,
                        int B, int V, int d, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  // Dispatch on a compile-time batch so that the accumulators live in registers.
  switch (B <= 1 ? 1 : B <= 2 ? 2 : B <= 4 ? 4 : B <= 8 ? 8 : B <= 16 ? 16 : B <= 32 ? 32 : 64) {
    case 1: launch<1>(h, q, scale, bias, y, V, d, stream); break;
    case 2: launch<2>(h, q, scale, bias, y, V, d, stream); break;
    case 4: launch<4>(h, q, scale, bias, y, V, d, stream); break;
    case 8: launch<8>(h, q, scale, bias, y, V, d, stream); break;
    case 16: launch<16>(h, q, scale, bias, y, V, d, stream); break;
    case 32: launch<32>(h, q, scale, bias, y, V, d, stream); break;
    default: launch<64>(h, q, scale, bias, y, V, d, stream); break;
  }
}

}  // namespace vllm_csv
