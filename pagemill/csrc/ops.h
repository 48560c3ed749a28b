// Declarations of pagemill's CPU kernels; bindings.cpp exposes them to Python as one extension.
#pragma once
#include <torch/extension.h>

// paged_attention.cpp
void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor block_tables, torch::Tensor query_start_loc, torch::Tensor context_lens,
                     double scale, int64_t window);

// layer_ops.cpp
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps);
void fused_add_rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void silu_and_mul(torch::Tensor out, torch::Tensor x);
void rope_and_cache(torch::Tensor q_out, torch::Tensor k_out, torch::Tensor v_out, torch::Tensor qkv,
                    torch::Tensor positions, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                    torch::Tensor v_cache, torch::Tensor slot_mapping);

// gemv.cpp: small-M (<= 16 rows) linear layers y = x W^T + b over packed fp16 / int8 / Q4_1 weights
torch::Tensor pack_gemv_weight_f16(torch::Tensor w);
void gemv_f16(torch::Tensor out, torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias);
std::vector<torch::Tensor> pack_gemv_weight_int8(torch::Tensor w, int64_t group_size);
void gemv_int8(torch::Tensor out, torch::Tensor x, torch::Tensor packed_q, torch::Tensor scales,
               c10::optional<torch::Tensor> bias);
std::vector<torch::Tensor> pack_gemv_weight_q4(torch::Tensor w, int64_t group_size);
double q4_max_error(torch::Tensor w, int64_t group_size);
void gemv_q4(torch::Tensor out, torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias);
