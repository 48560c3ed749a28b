// The Python module of pagemill's CPU kernels (plain pybind11: lower call overhead than torch.ops).
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Paged attention over the KV cache blocks (CPU, float32)");
  m.def("rms_norm", &rms_norm, "out = RMSNorm(x) * weight");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; out = RMSNorm(residual) * weight");
  m.def("silu_and_mul", &silu_and_mul, "out = silu(x[:, :I]) * x[:, I:]");
  m.def("rope_and_cache", &rope_and_cache, "RoPE on q/k from a fused qkv row, K/V written to the cache slots");
  m.def("pack_gemv_weight_f16", &pack_gemv_weight_f16, "Pack a [N, K] weight for gemv_f16: [ceil(N/64), K, 64] fp16");
  m.def("gemv_f16", &gemv_f16, "out = x @ W^T + bias for M <= 16 rows, W packed by pack_gemv_weight_f16",
        py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("bias") = py::none());
  m.def("pack_gemv_weight_int8", &pack_gemv_weight_int8,
        "Quantize + pack a [N, K] weight for gemv_int8: [q int8 [T, Kp, 64], scales fp32 [T, Kp/G, 64]]",
        py::arg("w"), py::arg("group_size"));
  m.def("gemv_int8", &gemv_int8, "out = x @ W^T + bias for M <= 16 rows, W from pack_gemv_weight_int8",
        py::arg("out"), py::arg("x"), py::arg("packed_q"), py::arg("scales"), py::arg("bias") = py::none());
  m.def("pack_gemv_weight_q4", &pack_gemv_weight_q4,
        "Recover Q4_1 (w = d*q + m per group) from a dequantized [N, K] weight and pack it for gemv_q4: "
        "[packed uint8 [T, K/G, G/2*64 + 256], max |d*q + m - w| / max |w| (float64 scalar)]",
        py::arg("w"), py::arg("group_size"));
  m.def("q4_max_error", &q4_max_error, "max |d*q + m - w| / max |w| of the Q4_1 fit of pack_gemv_weight_q4",
        py::arg("w"), py::arg("group_size"));
  m.def("gemv_q4", &gemv_q4, "out = x @ W^T + bias for M <= 16 rows, W packed by pack_gemv_weight_q4",
        py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("bias") = py::none());
}
