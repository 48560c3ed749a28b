// Weight packers for the GEMV kernels (packing.cpp); the layouts are the same for every ISA variant.
#pragma once
#include <torch/extension.h>

#include <tuple>
#include <vector>

constexpr int64_t kGemvTile = 64;  // output channels per packed tile

torch::Tensor pack_gemv_weight_f16(torch::Tensor w);
std::vector<torch::Tensor> pack_gemv_weight_int8(torch::Tensor w, int64_t group_size);
std::vector<torch::Tensor> pack_gemv_weight_q4(torch::Tensor w, int64_t group_size);
double q4_max_error(torch::Tensor w, int64_t group_size);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> pack_head_screen(torch::Tensor w);
