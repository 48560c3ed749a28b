// Declarations of pagemill's CPU kernels; bindings.cpp exposes them to Python as one extension.
#pragma once
#include <torch/extension.h>

// paged_attention.cpp
void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor block_tables, torch::Tensor query_start_loc, torch::Tensor context_lens,
                     double scale, int64_t window);
