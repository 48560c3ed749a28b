// One (token, KV head) row of a quantized KV cache written from float32 (kv_rows.cpp).
#pragma once

#include <cstdint>

#include "kernels.h"

namespace pagemill {

// x [D] -> codes (code i at codes + i * code_stride) and scales (scale j's bytes at scales + j * scale_stride: a
// float16 per kKvInt8Group channels for INT8, one float32 for fp8), by attention/kv_quant.py's rule, bit for bit as
// torch computes it; stored[i] = the value the cache now holds (code times scale).
void quantize_kv_row(KvQuant quant, const float* x, int64_t D, uint8_t* codes, int64_t code_stride, uint8_t* scales,
                     int64_t scale_stride, float* stored);

}  // namespace pagemill
