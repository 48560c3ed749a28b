// The vector layer of the kernel variants: one `vf` of W fp32 lanes with loads / stores that widen fp16 / bf16 /
// int8 and narrow back, for the ISA this translation unit is compiled for (-D PAGEMILL_ISA=<variant> plus that
// variant's -m flags): AVX-512 (W = 16), AVX2 + FMA + F16C (W = 8), or portable C++ (W = 8, auto-vectorised).
// Everything lives in namespace pagemill::PAGEMILL_ISA, and the variants use no std:: template with out-of-line
// code, so two variants never share a linker symbol (tests/kernels/test_kernel_build.py checks the objects).
#pragma once
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "../kernels.h"

#ifndef PAGEMILL_ISA
#error "compile kernel variants with -DPAGEMILL_ISA=<variant name>"
#endif

namespace pagemill {
namespace PAGEMILL_ISA {

struct f16 {
  uint16_t bits;
};
struct bf16 {
  uint16_t bits;
};

inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

inline uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// Scalar conversions, integer-only so -ffast-math cannot change them; round to nearest even like torch. (F16C's
// widening is exact too, and a single instruction where the attention kernel reads a float16 scale per V chunk.)
inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#endif
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0x1F) return bits_f32(sign | 0x7F800000u | (m << 13));
  if (e == 0) {
    if (m == 0) return bits_f32(sign);
    e = 1;
    while (!(m & 0x400u)) {
      m <<= 1;
      --e;
    }
    m &= 0x3FFu;
  }
  return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

inline uint16_t f32_to_f16(float f) {
  const uint32_t x = f32_bits(f), ax = x & 0x7FFFFFFFu;
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  if (ax >= 0x7F800000u) return sign | (ax > 0x7F800000u ? 0x7E00u : 0x7C00u);
  if (ax >= 0x477FF000u) return sign | 0x7C00u;  // rounds to 65536 or more: inf
  uint32_t r, rem, half;
  if (ax < 0x38800000u) {  // below fp16's smallest normal: a subnormal (units of 2^-24) or zero
    if (ax <= 0x33000000u) return sign;
    const uint32_t m = (ax & 0x7FFFFFu) | 0x800000u, shift = 126u - (ax >> 23);
    r = m >> shift;
    rem = m & ((1u << shift) - 1u);
    half = 1u << (shift - 1u);
  } else {
    r = (ax - 0x38000000u) >> 13;
    rem = ax & 0x1FFFu;
    half = 0x1000u;
  }
  if (rem > half || (rem == half && (r & 1u))) ++r;
  return sign | uint16_t(r);
}

inline float bf16_to_f32(uint16_t b) { return bits_f32(uint32_t(b) << 16); }
inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float to_f32(float x) { return x; }
inline float to_f32(f16 x) { return f16_to_f32(x.bits); }
inline float to_f32(bf16 x) { return bf16_to_f32(x.bits); }
inline void from_f32(float* p, float x) { *p = x; }
inline void from_f32(f16* p, float x) { p->bits = f32_to_f16(x); }
inline void from_f32(bf16* p, float x) { p->bits = f32_to_bf16(x); }

// One-byte KV-cache codes (pagemill/attention/kv_quant.py; each row's float32 scale is applied by the kernel): int8,
// fp8 e4m3 (bias 7, no infinities) and fp8 e5m2 (the top byte of an fp16). Loads widen them in registers.
struct i8q {
  int8_t bits;
};
struct e4m3 {
  uint8_t bits;
};
struct e5m2 {
  uint8_t bits;
};
template <typename T>
struct is_code {
  static constexpr bool value = false;
};
template <>
struct is_code<i8q> {
  static constexpr bool value = true;
};
template <>
struct is_code<e4m3> {
  static constexpr bool value = true;
};
template <>
struct is_code<e5m2> {
  static constexpr bool value = true;
};
// e4m3 as fp16 bits: sign to bit 15, exponent and mantissa 7 bits up; that fp16 is the e4m3 value / 256 (biases 15
// and 7), subnormals included, so one fp16 widening and a multiply by 256 decode it.
inline uint16_t e4m3_as_f16_bits(uint8_t b) { return uint16_t(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7)); }
inline float to_f32(i8q x) { return float(x.bits); }
inline float to_f32(e4m3 x) { return f16_to_f32(e4m3_as_f16_bits(x.bits)) * 256.0f; }
inline float to_f32(e5m2 x) { return f16_to_f32(uint16_t(x.bits << 8)); }

#if defined(__AVX512F__)
// ---------------------------------------------------------------------------------------------------- AVX-512
constexpr int W = 16;
constexpr int kVecRegs = 32;
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset(float x) { return _mm512_set1_ps(x); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c
inline vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
inline __mmask16 lanes(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u); }

inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload(const f16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline vf widen_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline vf vload(const bf16* p) { return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline vf vload_part(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(lanes(n), p); }
inline vf vload_part(const f16* p, int64_t n) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes(n), p)); }
inline vf vload_part(const bf16* p, int64_t n) { return widen_bf16(_mm256_maskz_loadu_epi16(lanes(n), p)); }
inline vf vload_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vf vload_u8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m128i load_part8(const void* p, int64_t n) {  // the first n (< 16) bytes, the rest zero
  alignas(16) uint8_t tmp[16] = {0};
  memcpy(tmp, p, size_t(imin(n, 16)));
  return _mm_load_si128(reinterpret_cast<const __m128i*>(tmp));
}
inline vf widen_codes(__m128i b, i8q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
inline vf widen_codes(__m128i b, e4m3) {
  const __m256i w = _mm256_cvtepu8_epi16(b);
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}
inline vf widen_codes(__m128i b, e5m2) { return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8)); }
template <typename C, typename = std::enable_if_t<is_code<C>::value>>
inline vf vload(const C* p) {
  return widen_codes(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), C{});
}
template <typename C, typename = std::enable_if_t<is_code<C>::value>>
inline vf vload_part(const C* p, int64_t n) {
  return widen_codes(load_part8(p, n), C{});
}

inline __m256i narrow_bf16(vf v) {  // round to nearest even, NaN -> 0x7FC0 (torch's rule)
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
inline __m256i narrow_f16(vf v) { return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline void vstore(f16* p, vf v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow_f16(v)); }
inline void vstore(bf16* p, vf v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow_bf16(v)); }
inline void vstore_part(float* p, vf v, int64_t n) { _mm512_mask_storeu_ps(p, lanes(n), v); }
inline void vstore_part(f16* p, vf v, int64_t n) { _mm256_mask_storeu_epi16(p, lanes(n), narrow_f16(v)); }
inline void vstore_part(bf16* p, vf v, int64_t n) { _mm256_mask_storeu_epi16(p, lanes(n), narrow_bf16(v)); }
inline void prefetch_l1(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

#elif defined(__AVX2__)
// ----------------------------------------------------------------------------------------- AVX2 + FMA + F16C
#if !defined(__FMA__) || !defined(__F16C__)
#error "the avx2 variant needs -mfma -mf16c"
#endif
constexpr int W = 8;
constexpr int kVecRegs = 16;
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset(float x) { return _mm256_set1_ps(x); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
inline __m256i lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(imin(n, 8))), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload(const f16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vf widen_bf16(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline vf vload(const bf16* p) { return widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m128i load_part16(const void* p, int64_t n) {  // no 16-bit masked load in AVX2: via a zeroed copy
  alignas(16) uint16_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  memcpy(tmp, p, size_t(imin(n, 8)) * 2);
  return _mm_load_si128(reinterpret_cast<const __m128i*>(tmp));
}
inline vf vload_part(const float* p, int64_t n) { return _mm256_maskload_ps(p, lanes(n)); }
inline vf vload_part(const f16* p, int64_t n) { return _mm256_cvtph_ps(load_part16(p, n)); }
inline vf vload_part(const bf16* p, int64_t n) { return widen_bf16(load_part16(p, n)); }
inline vf vload_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vf vload_u8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m128i load_part8(const void* p, int64_t n) {  // the first n (< 8) bytes, the rest zero
  alignas(16) uint8_t tmp[16] = {0};
  memcpy(tmp, p, size_t(imin(n, 8)));
  return _mm_load_si128(reinterpret_cast<const __m128i*>(tmp));
}
inline vf widen_codes(__m128i b, i8q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }
inline vf widen_codes(__m128i b, e4m3) {
  const __m128i w = _mm_cvtepu8_epi16(b);
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
}
inline vf widen_codes(__m128i b, e5m2) { return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(b), 8)); }
template <typename C, typename = std::enable_if_t<is_code<C>::value>>
inline vf vload(const C* p) {
  return widen_codes(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), C{});
}
template <typename C, typename = std::enable_if_t<is_code<C>::value>>
inline vf vload_part(const C* p, int64_t n) {
  return widen_codes(load_part8(p, n), C{});
}

inline __m128i narrow_bf16(vf v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // pack the eight 32-bit lanes to 16 bits: packus works per 128-bit half, then gather the two low quadwords
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}
inline __m128i narrow_f16(vf v) { return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline void store_part16(void* p, __m128i h, int64_t n) {
  alignas(16) uint16_t tmp[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(tmp), h);
  memcpy(p, tmp, size_t(imin(n, 8)) * 2);
}
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline void vstore(f16* p, vf v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), narrow_f16(v)); }
inline void vstore(bf16* p, vf v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), narrow_bf16(v)); }
inline void vstore_part(float* p, vf v, int64_t n) { _mm256_maskstore_ps(p, lanes(n), v); }
inline void vstore_part(f16* p, vf v, int64_t n) { store_part16(p, narrow_f16(v), n); }
inline void vstore_part(bf16* p, vf v, int64_t n) { store_part16(p, narrow_bf16(v), n); }
inline void prefetch_l1(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

#else
// ---------------------------------------------------------------------------------------------- portable C++
// Arrays of W floats in plain loops; the compiler vectorises them for its target (SSE2, NEON, ...).
constexpr int W = 8;
constexpr int kVecRegs = 16;
struct vf {
  float v[W];
};
inline vf vzero() {
  vf r;
  for (int i = 0; i < W; ++i) r.v[i] = 0.0f;
  return r;
}
inline vf vset(float x) {
  vf r;
  for (int i = 0; i < W; ++i) r.v[i] = x;
  return r;
}
#define PAGEMILL_LANEWISE(NAME, EXPR)                   \
  inline vf NAME(vf a, vf b) {                          \
    vf r;                                               \
    for (int i = 0; i < W; ++i) r.v[i] = (EXPR);        \
    return r;                                           \
  }
PAGEMILL_LANEWISE(vadd, a.v[i] + b.v[i])
PAGEMILL_LANEWISE(vsub, a.v[i] - b.v[i])
PAGEMILL_LANEWISE(vmul, a.v[i] * b.v[i])
#undef PAGEMILL_LANEWISE
inline vf vfma(vf a, vf b, vf c) {
  vf r;
  for (int i = 0; i < W; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i];
  return r;
}
inline vf vfnma(vf a, vf b, vf c) {
  vf r;
  for (int i = 0; i < W; ++i) r.v[i] = c.v[i] - a.v[i] * b.v[i];
  return r;
}
inline float vsum(vf a) {
  float s = 0.0f;
  for (int i = 0; i < W; ++i) s += a.v[i];
  return s;
}
template <typename T>
inline vf vload_part(const T* p, int64_t n) {
  vf r;
  for (int i = 0; i < W; ++i) r.v[i] = i < n ? to_f32(p[i]) : 0.0f;
  return r;
}
template <typename T>
inline vf vload(const T* p) {
  vf r;
  for (int i = 0; i < W; ++i) r.v[i] = to_f32(p[i]);
  return r;
}
inline vf vload_i8(const int8_t* p) {
  vf r;
  for (int i = 0; i < W; ++i) r.v[i] = float(p[i]);
  return r;
}
inline vf vload_u8(const uint8_t* p) {
  vf r;
  for (int i = 0; i < W; ++i) r.v[i] = float(p[i]);
  return r;
}
template <typename T>
inline void vstore_part(T* p, vf v, int64_t n) {
  for (int i = 0; i < W && i < n; ++i) from_f32(p + i, v.v[i]);
}
template <typename T>
inline void vstore(T* p, vf v) {
  for (int i = 0; i < W; ++i) from_f32(p + i, v.v[i]);
}
inline void prefetch_l1(const void* p) { __builtin_prefetch(p, 0, 3); }
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }
#endif

#if defined(__AVX512VNNI__)
// acc += the dword dot products of unsigned bytes u and signed bytes s. In inline assembly: around the intrinsic,
// GCC 12 copied each accumulator to a scratch register and back (two moves per product), so the front end, not the
// multiplier, bounded the inner loops (the panels' and the head screen's: 16 moves per 8 products).
inline __m512i dpbusd(__m512i acc, __m512i u, __m512i s) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
}
#endif

// n >= W lanes: a full vector; fewer: the first n lanes, the rest zero (loads) or untouched (stores).
template <typename T>
inline vf vloadn(const T* p, int64_t n) {
  return n >= W ? vload(p) : vload_part(p, n);
}
template <typename T>
inline void vstoren(T* p, vf v, int64_t n) {
  if (n >= W)
    vstore(p, v);
  else
    vstore_part(p, v, n);
}

// Calls f(Count<c>{}) with c = min(n, Max) for a runtime n >= 1, so kernels keep per-row / per-head
// accumulators in registers with compile-time loop bounds.
template <int N>
struct Count {
  static constexpr int value = N;
};
template <int Max, typename F>
inline void with_static_count(int n, const F& f) {
  if constexpr (Max > 1) {
    if (n < Max) return with_static_count<Max - 1>(n, f);
  }
  f(Count<Max>{});
}

// Calls f(T{}) with T the element type of a float dtype.
template <typename F>
inline void with_float_type(DType t, const F& f) {
  switch (t) {
    case DType::F32: return f(float{});
    case DType::F16: return f(f16{});
    case DType::BF16: return f(bf16{});
  }
}

// f(begin, end) over [0, n) split into at most num_threads contiguous ranges of at least `grain` items; runs
// inline (no thread wake-up) when there is one range or when already inside a parallel region.
template <typename F>
inline void parallel_for(int64_t n, int64_t grain, int num_threads, const F& f) {
  if (n <= 0) return;
  const int64_t ranges = imin(imax(1, num_threads), imax(1, (n + grain - 1) / imax(1, grain)));
  if (ranges <= 1 || omp_in_parallel()) return f(int64_t(0), n);
  const int64_t per = (n + ranges - 1) / ranges;
#pragma omp parallel num_threads(int(ranges))
  {
    const int64_t b = int64_t(omp_get_thread_num()) * per, e = imin(n, b + per);
    if (b < e) f(b, e);
  }
}

// A thread's growable scratch buffer (aligned_alloc'd; no std::vector in the variants).
struct Scratch {
  float* data = nullptr;
  int64_t size = 0;
  float* get(int64_t n) {
    if (n > size) {
      free(data);
      // 64-byte aligned: vectors read from a buffer never straddle cache lines
      data = static_cast<float*>(aligned_alloc(64, size_t(round_up(n * int64_t(sizeof(float)), 64))));
      size = n;
    }
    return data;
  }
  ~Scratch() { free(data); }
};

}  // namespace PAGEMILL_ISA
}  // namespace pagemill
