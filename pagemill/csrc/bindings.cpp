// The Python module of pagemill's CPU kernels (plain pybind11: lower call overhead than torch.ops).
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Paged attention over the KV cache blocks (CPU, float32)");
  m.def("rms_norm", &rms_norm, "out = RMSNorm(x) * weight");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; out = RMSNorm(residual) * weight");
  m.def("silu_and_mul", &silu_and_mul, "out = silu(x[:, :I]) * x[:, I:]");
  m.def("rope_and_cache", &rope_and_cache, "RoPE on q/k from a fused qkv row, K/V written to the cache slots");
}
