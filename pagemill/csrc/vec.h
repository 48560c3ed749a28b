// 16-lane AVX-512 loads/stores that widen fp16/bf16 to fp32 and narrow back (masked for tails).
#pragma once
#include <immintrin.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>
#include <utility>

namespace pagemill {

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u); }

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(c10::Half* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store16(c10::BFloat16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

// Calls f(std::integral_constant<int, c>) with c = min(n, Max) for a runtime n >= 1, so a kernel can keep its
// per-row / per-head accumulators in registers with compile-time loop bounds.
template <int Max, typename F>
inline void with_static_count(int n, F&& f) {
  if constexpr (Max > 1) {
    if (n < Max) return with_static_count<Max - 1>(n, std::forward<F>(f));
  }
  f(std::integral_constant<int, Max>{});
}

}  // namespace pagemill

// Dispatch on a floating tensor dtype (fp32 / fp16 / bf16), binding the C++ type to NAME.
#define PAGEMILL_DISPATCH_FLOAT(DTYPE, NAME, ...)                                  \
  [&] {                                                                            \
    switch (DTYPE) {                                                               \
      case at::kFloat: { using NAME = float; return __VA_ARGS__(); }               \
      case at::kHalf: { using NAME = c10::Half; return __VA_ARGS__(); }            \
      case at::kBFloat16: { using NAME = c10::BFloat16; return __VA_ARGS__(); }    \
      default: TORCH_CHECK(false, "unsupported dtype ", DTYPE);                    \
    }                                                                              \
  }()
