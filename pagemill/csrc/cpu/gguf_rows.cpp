// Rows of a GGUF block-quantized matrix as float32, decoded straight from the file's blocks (row r: its K / block
// length blocks at blocks + r * row_bytes). The values are gguf.quants' (the float32 weights transformers loads), bit
// for bit: each product and sum is rounded once, in the numpy expression's order. So the file's bytes are the only
// copy a quantized embedding table or LM head needs: the embedding looks its rows up here, the greedy head screen
// rechecks its candidates here. Compiled with the bindings' baseline flags; fp-contract=off keeps d * q + m two
// roundings where the target has FMA (aarch64).
#include "gguf_rows.h"

#include <cstring>

namespace pagemill {
namespace {

constexpr int64_t QK_K = 256;

#define PM_EXACT __attribute__((optimize("fp-contract=off")))

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0x1Fu) {
    bits = sign | 0x7F800000u | (man << 13);  // inf / NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal half: normalise
    int e = -1;
    uint32_t m = man;
    do {
      ++e;
      m <<= 1;
    } while (!(m & 0x400u));
    bits = sign | (uint32_t(112 - e) << 23) | ((m & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Q4_K / Q5_K's 6-bit scale and min of sub-block j (gguf.quants.Q4_K.get_scale_min).
inline void k_scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

PM_EXACT void q4_0(const uint8_t* b, float* y) {  // d * (q - 8)
  const float d = f16_at(b);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * float(int(b[2 + j] & 15) - 8);
    y[j + 16] = d * float(int(b[2 + j] >> 4) - 8);
  }
}

PM_EXACT void q4_1(const uint8_t* b, float* y) {  // (d * q) + m
  const float d = f16_at(b), m = f16_at(b + 2);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * float(b[4 + j] & 15) + m;
    y[j + 16] = d * float(b[4 + j] >> 4) + m;
  }
}

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

PM_EXACT void q5_0(const uint8_t* b, float* y) {  // d * (q - 16)
  const float d = f16_at(b);
  const uint32_t qh = u32_at(b + 2);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * float(int((qs[j] & 15) | (((qh >> j) & 1) << 4)) - 16);
    y[j + 16] = d * float(int((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
  }
}

PM_EXACT void q5_1(const uint8_t* b, float* y) {  // (d * q) + m
  const float d = f16_at(b), m = f16_at(b + 2);
  const uint32_t qh = u32_at(b + 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * float((qs[j] & 15) | (((qh >> j) & 1) << 4)) + m;
    y[j + 16] = d * float((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) + m;
  }
}

PM_EXACT void q8_0(const uint8_t* b, float* y) {  // q * d
  const float d = f16_at(b);
  for (int j = 0; j < 32; ++j) y[j] = float(int8_t(b[2 + j])) * d;
}

PM_EXACT void q2_k(const uint8_t* b, float* y) {  // (d sc) q - (dmin mn), 16 groups of 16
  const uint8_t *scales = b, *qs = b + 16;
  const float d = f16_at(b + 80), dmin = f16_at(b + 82);
  for (int i = 0; i < QK_K; ++i) {
    const int h = i / 128, s = (i % 128) / 32, l = i % 32, g = i / 16;
    const float q = float((qs[h * 32 + l] >> (2 * s)) & 3);
    const float dl = d * float(scales[g] & 15), ml = dmin * float(scales[g] >> 4);
    y[i] = dl * q - ml;
  }
}

PM_EXACT void q3_k(const uint8_t* b, float* y) {  // (d sc) q, q = ql - 4 (1 - hbit), 16 groups of 16
  const uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
  const float d = f16_at(b + 108);
  float dl[16];
  for (int j = 0; j < 16; ++j) {
    const int low = (sc[j % 8] >> (4 * (j / 8))) & 15, high = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
    dl[j] = d * float(int8_t(low | (high << 4)) - 32);
  }
  for (int i = 0; i < QK_K; ++i) {
    const int h = i / 128, s = (i % 128) / 32, l = i % 32;
    const int ql = (qs[h * 32 + l] >> (2 * s)) & 3, hb = (hmask[i % 32] >> (i / 32)) & 1;
    y[i] = dl[i / 16] * float(ql - ((hb ^ 1) << 2));
  }
}

PM_EXACT void q4_k(const uint8_t* b, float* y) {  // (D sc) q - (Dmin mn), 8 groups of 32
  const float d = f16_at(b), dmin = f16_at(b + 2);
  const uint8_t *s = b + 4, *qs = b + 16;
  for (int g = 0; g < 8; ++g) {
    int sc, mn;
    k_scale_min(s, g, sc, mn);
    const float dl = d * float(sc), ml = dmin * float(mn);
    const int c = g / 2, shift = 4 * (g % 2);
    for (int l = 0; l < 32; ++l) y[g * 32 + l] = dl * float((qs[c * 32 + l] >> shift) & 15) - ml;
  }
}

PM_EXACT void q5_k(const uint8_t* b, float* y) {  // (D sc) q - (Dmin mn), 5-bit codes
  const float d = f16_at(b), dmin = f16_at(b + 2);
  const uint8_t *s = b + 4, *qh = b + 16, *qs = b + 48;
  for (int g = 0; g < 8; ++g) {
    int sc, mn;
    k_scale_min(s, g, sc, mn);
    const float dl = d * float(sc), ml = dmin * float(mn);
    const int c = g / 2, shift = 4 * (g % 2);
    for (int l = 0; l < 32; ++l) {
      const int q = ((qs[c * 32 + l] >> shift) & 15) | (((qh[l] >> g) & 1) << 4);
      y[g * 32 + l] = dl * float(q) - ml;
    }
  }
}

PM_EXACT void q6_k(const uint8_t* b, float* y) {  // (D sc) (q - 32), 16 groups of 16
  const uint8_t *ql = b, *qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = f16_at(b + 208);
  // Each half of 128 values as four runs of 32 sharing their ql / qh bytes (ggml's order): loops the compiler
  // vectorizes (the greedy head screen decodes its candidate rows here).
  for (int h = 0; h < 2; ++h, ql += 64, qh += 32, sc += 8, y += 128)
    for (int l = 0; l < 32; ++l) {
      const int s = l / 16;
      y[l] = (d * float(sc[s])) * float(((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32);
      y[l + 32] = (d * float(sc[s + 2])) * float(((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
      y[l + 64] = (d * float(sc[s + 4])) * float(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
      y[l + 96] = (d * float(sc[s + 6])) * float(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
    }
}

constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// 32 values d * kvalues[i] from 16 bytes of 4-bit indices (element j: the low nibble of byte j, j + 16: the high one).
PM_EXACT inline void iq4_run(float d, const uint8_t* qs, float* y) {
  for (int j = 0; j < 16; ++j) {
    y[j] = d * float(kIQ4Values[qs[j] & 15]);
    y[j + 16] = d * float(kIQ4Values[qs[j] >> 4]);
  }
}

PM_EXACT void iq4_nl(const uint8_t* b, float* y) { iq4_run(f16_at(b), b + 2, y); }

PM_EXACT void iq4_xs(const uint8_t* b, float* y) {  // (D (ls - 32)) kvalues[i], 8 runs of 32
  const float d = f16_at(b);
  const unsigned scales_h = unsigned(b[2]) | unsigned(b[3]) << 8;
  for (int ib = 0; ib < 8; ++ib) {
    const int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 15) | (((scales_h >> (2 * ib)) & 3) << 4);
    iq4_run(d * float(ls - 32), b + 8 + 16 * ib, y + 32 * ib);
  }
}

// 16-bit tables (F16, BF16) read in runs of 32: a 16-bit LM head's rows for the greedy head screen's rechecks.
void f16_run(const uint8_t* b, float* y) {
  for (int j = 0; j < 32; ++j) y[j] = f16_at(b + 2 * j);
}

void bf16_run(const uint8_t* b, float* y) {
  for (int j = 0; j < 32; ++j) {
    const uint32_t bits = uint32_t(b[2 * j] | b[2 * j + 1] << 8) << 16;
    std::memcpy(y + j, &bits, 4);
  }
}

using BlockFn = void (*)(const uint8_t*, float*);

struct Format {
  BlockFn fn;
  int64_t length, bytes;
};

bool format_of(int ggml_type, Format& f) {
  switch (ggml_type) {
    case 1: f = {f16_run, 32, 64}; return true;
    case 2: f = {q4_0, 32, 18}; return true;
    case 3: f = {q4_1, 32, 20}; return true;
    case 6: f = {q5_0, 32, 22}; return true;
    case 7: f = {q5_1, 32, 24}; return true;
    case 8: f = {q8_0, 32, 34}; return true;
    case 10: f = {q2_k, QK_K, 84}; return true;
    case 11: f = {q3_k, QK_K, 110}; return true;
    case 12: f = {q4_k, QK_K, 144}; return true;
    case 13: f = {q5_k, QK_K, 176}; return true;
    case 14: f = {q6_k, QK_K, 210}; return true;
    case 20: f = {iq4_nl, 32, 18}; return true;
    case 23: f = {iq4_xs, QK_K, 136}; return true;
    case 30: f = {bf16_run, 32, 64}; return true;
  }
  return false;
}

}  // namespace

bool gguf_row_format(int ggml_type, int64_t* block_length, int64_t* block_bytes) {
  Format f;
  if (!format_of(ggml_type, f)) return false;
  *block_length = f.length;
  *block_bytes = f.bytes;
  return true;
}

void gguf_dequantize_rows(const GGUFRows& src, const int64_t* rows, int64_t n, float* out) {
  Format f;
  if (!format_of(src.ggml_type, f)) return;
  const int64_t nb = src.K / f.length;
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* row = src.blocks + rows[i] * src.row_bytes;
    float* y = out + i * src.K;
    for (int64_t b = 0; b < nb; ++b) f.fn(row + b * f.bytes, y + b * f.length);
  }
}

void gguf_dequantize_rows_cb(const void* src, const int64_t* rows, int64_t n, float* out) {
  gguf_dequantize_rows(*static_cast<const GGUFRows*>(src), rows, n, out);
}

}  // namespace pagemill
