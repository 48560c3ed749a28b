// Quantized KV cache rows written from float32 (attention/kv_quant.py's format and rule): compiled with the bindings'
// baseline flags, not the variants' -ffast-math, so every division, product and rounding is torch's and the kernel
// writes the bytes the torch reference writes (the fused RoPE + cache write, and whatever the reference wrote before
// a prefix hit or a swap, are the same codes). c10's own float16 / fp8 conversions round as torch's casts do.
#include "kv_rows.h"

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstring>

namespace pagemill {
namespace {

constexpr float kF16Max = 65504.0f;

void int8_row(const float* x, int64_t D, uint8_t* codes, int64_t code_stride, uint8_t* scales, int64_t scale_stride,
              float* stored) {
  for (int64_t g0 = 0, j = 0; g0 < D; g0 += kKvInt8Group, ++j) {
    const int64_t g1 = g0 + kKvInt8Group < D ? g0 + kKvInt8Group : D;
    float amax = 0.0f;
    for (int64_t i = g0; i < g1; ++i) amax = std::fmax(amax, std::fabs(x[i]));
    const float s = std::fmin(amax / 127.0f, kF16Max);
    const c10::Half half(s);  // round to nearest even, as torch's .to(float16)
    const float sf = static_cast<float>(half), div = sf > 0.0f ? sf : 1.0f;
    std::memcpy(scales + j * scale_stride, &half.x, 2);
    for (int64_t i = g0; i < g1; ++i) {
      float y = std::nearbyint(x[i] / div);  // ties to even, as torch.round
      y = std::fmin(std::fmax(y, -127.0f), 127.0f);
      const int8_t code = static_cast<int8_t>(y);
      codes[i * code_stride] = static_cast<uint8_t>(code);
      stored[i] = static_cast<float>(code) * sf;
    }
  }
}

template <typename F8>
void fp8_row(const float* x, int64_t D, float qmax, uint8_t* codes, int64_t code_stride, uint8_t* scales,
             float* stored) {
  float amax = 0.0f;
  for (int64_t i = 0; i < D; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  const float scale = amax / qmax, inv = amax > 0.0f ? qmax / amax : 0.0f;
  std::memcpy(scales, &scale, 4);
  for (int64_t i = 0; i < D; ++i) {
    const F8 code(std::fmin(std::fmax(x[i] * inv, -qmax), qmax));
    codes[i * code_stride] = code.x;
    stored[i] = static_cast<float>(code) * scale;
  }
}

}  // namespace

void quantize_kv_row(KvQuant quant, const float* x, int64_t D, uint8_t* codes, int64_t code_stride, uint8_t* scales,
                     int64_t scale_stride, float* stored) {
  switch (quant) {
    case KvQuant::INT8: return int8_row(x, D, codes, code_stride, scales, scale_stride, stored);
    case KvQuant::FP8_E4M3: return fp8_row<c10::Float8_e4m3fn>(x, D, 448.0f, codes, code_stride, scales, stored);
    case KvQuant::FP8_E5M2: return fp8_row<c10::Float8_e5m2>(x, D, 57344.0f, codes, code_stride, scales, stored);
    case KvQuant::NONE: break;
  }
}

}  // namespace pagemill
