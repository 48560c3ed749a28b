// Rows of a GGUF block-quantized matrix decoded to float32 with gguf.quants' arithmetic (gguf_rows.cpp).
#pragma once

#include <cstdint>

namespace pagemill {

// A [N, K] matrix of ggml type `ggml_type` (Q4_0 .. Q8_0, Q2_K .. Q6_K, IQ4_NL, IQ4_XS; F16 / BF16
// read as blocks of 32) whose row r is at blocks + r * row_bytes.
struct GGUFRows {
  const uint8_t* blocks;
  int64_t row_bytes, K;
  int ggml_type;
};

// False for a type this file does not decode; else the elements and bytes of one block.
bool gguf_row_format(int ggml_type, int64_t* block_length, int64_t* block_bytes);
// out[i, :] = row rows[i] of src as float32, for i < n (rows must be in range).
void gguf_dequantize_rows(const GGUFRows& src, const int64_t* rows, int64_t n, float* out);
// The same with src as an opaque GGUFRows pointer: the head screen's row source (kernels.h: TableRows).
void gguf_dequantize_rows_cb(const void* src, const int64_t* rows, int64_t n, float* out);

}  // namespace pagemill
