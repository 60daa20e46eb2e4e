// Torch binding of the csrc kernels: vllm_csv._C.int8_screen(h, q, scale, bias?) -> y.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

#include "int8_screen.cuh"

namespace {

torch::Tensor int8_screen(torch::Tensor h, torch::Tensor q, torch::Tensor scale, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(h.is_cuda() && q.is_cuda() && scale.is_cuda(), "int8_screen: CUDA tensors expected");
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.dim() == 2 && q.is_contiguous(), "q must be int8 [V, d]");
  h = h.to(torch::kFloat32).contiguous();
  scale = scale.to(torch::kFloat32).contiguous();
  const int64_t B = h.size(0), V = q.size(0), d = q.size(1);
  TORCH_CHECK(h.size(1) == d && scale.numel() == V, "shape mismatch");
  torch::Tensor b;
  if (bias.has_value()) b = bias->to(torch::kFloat32).contiguous();
  auto y = torch::empty({B, V}, h.options());
  auto stream = at::cuda::getCurrentCUDAStream().stream();
  for (int64_t s = 0; s < B; s += vllm_csv::kMaxBatch) {
    const int64_t n = std::min<int64_t>(vllm_csv::kMaxBatch, B - s);
    vllm_csv::launch_int8_screen(h.data_ptr<float>() + s * d, q.data_ptr<int8_t>(), scale.data_ptr<float>(),
                                 b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>() + s * V,
                                 static_cast<int>(n), static_cast<int>(V), static_cast<int>(d), stream);
  }
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_screen", &int8_screen, "y = s * (q @ h) (+ bias), fp32 accumulation");
}
