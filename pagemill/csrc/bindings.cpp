// The Python module of pagemill's CPU kernels (plain pybind11: lower call overhead than torch.ops).
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Paged attention over the KV cache blocks (CPU, float32)");
}
