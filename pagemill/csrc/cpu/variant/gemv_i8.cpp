// Linear layers with int8 activations (linear_dtype="int8", llama.cpp's scheme). x is quantized per row and block of
// XB = 32 along K (symmetric: scale dx = max|x| / 127, codes round-to-nearest-even in [-127, 127]); each k block of a
// tile's weights is laid out once into a panel of integer codes, four consecutive k of a channel in one dword (the
// operand of vpdpbusd, or of maddubs + madd without VNNI), which every row block then multiplies in integers. The
// integer sums of a span (min(G, XB) k) become float once per row and channel:
//   y += isum * (d * dx) + m * (sum of x over the group)
// with the min term taken from the float x (exact). 4-bit records: codes 0..15 are the unsigned operand (a span of
// <= 8 quads fits 16-bit sums: 8 * 2 * 15 * 127 < 2^15); int8 tiles: signed codes, by the sign trick (|w| unsigned,
// x carrying w's sign). With VNNI, Q4_K and Q6_K take llama.cpp's Q8_K scheme instead (x per super-block of 256,
// integer sub-scales, one float epilogue per super-block: "Integer-scaled super-blocks" below).
//
// Panel: [KBI / 4 quads][2 halves of 32 channels][4 vectors][32 bytes]. Vector n of half h holds, in its lane L and
// dword i, channel 32 h + 16 L + 4 n + i (the order the byte / word unpacks give), bytes k .. k + 3. With VNNI a
// quad is four zmm as the 512-bit unpacks give them: zmm n, lane L, dword i holds channel 16 L + 4 n + i.
#include "gemv_common.h"

namespace pagemill {
namespace PAGEMILL_ISA {
namespace {

constexpr int64_t XB = 32;    // activation quantization block along K
constexpr int64_t KBI = 256;  // k per panel (16 KiB: stays in L1 while every row block reads it)
constexpr int64_t PV = 32;    // bytes per panel vector: 8 channels x 4 k
constexpr int RMAX = 3;       // rows per register block (ymm: 12 accumulators; zmm: 12 float + 12 integer)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PAGEMILL_I8_ZMM 1  // 512-bit: a quad row of the panel (64 channels) is four zmm
#endif

// x [M, K] -> L = 3 levels of codes per row (the exact default's split on AVX2), q [M L, Kq] (row m level l at
// m L + l), per-32 scales dx [M L, Kq / XB]: x = s1 q1 + s2 q2 + s3 q3 + r with s_{l+1} = s_l / 254.
template <int L>
void split_x(const GemvArgs& a, int64_t Kq, int8_t* q, float* dx, int64_t b0 = 0, int64_t b1 = -1) {
  const int64_t K = a.K, nb = Kq / XB;
  if (b1 < 0) b1 = nb;
  for (int64_t m = 0; m < a.M; ++m)
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t k0 = b * XB, n = imax(0, imin(XB, K - k0));
      float r[XB], amax = 0.0f;
      for (int64_t i = 0; i < XB; ++i) {
        r[i] = i < n ? a.x[m * K + k0 + i] : 0.0f;
        amax = fmaxf(amax, fabsf(r[i]));
      }
      float s = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      for (int l = 0; l < L; ++l) {
        dx[(m * L + l) * nb + b] = s;
        int8_t* ql = q + (m * L + l) * Kq + k0;
        for (int64_t i = 0; i < XB; ++i) {
          int v = int(lrintf(r[i] * inv));
          v = v > 127 ? 127 : (v < -127 ? -127 : v);
          ql[i] = int8_t(v);
          r[i] = fmaf(-float(v), s, r[i]);
        }
        s /= 254.0f, inv *= 254.0f;
      }
    }
}

// The int8 preset's codes of x [M, K]: q [M, Kq] (zero beyond K) and per block of 32 the scale dx [M, Kq / XB].
struct XCodes {
  int8_t* q;
  float* dx;
};

// Blocks [b0, b1) of every row's codes.
void code_blocks(const GemvArgs& a, int64_t Kq, const XCodes& c, int64_t b0, int64_t b1) {
  const int64_t K = a.K, nb = Kq / XB;
  for (int64_t m = 0; m < a.M; ++m)
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t k0 = b * XB, n = imax(0, imin(XB, K - k0));
      const float* x = a.x + m * K + k0;
      int8_t* ql = c.q + m * Kq + k0;
#if defined(PAGEMILL_I8_ZMM)
      if (n == XB) {  // a whole block in two zmm: the same products and round-to-nearest-even as below
        const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const __m512i lim = _mm512_set1_epi32(127), nlim = _mm512_set1_epi32(-127);
        const __m512i q0 = _mm512_min_epi32(lim, _mm512_max_epi32(nlim, _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv))));
        const __m512i q1 = _mm512_min_epi32(lim, _mm512_max_epi32(nlim, _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv))));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(ql), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(ql + 16), _mm512_cvtepi32_epi8(q1));
        c.dx[m * nb + b] = amax / 127.0f;
        continue;
      }
#endif
      float amax = 0.0f;
      for (int64_t i = 0; i < n; ++i) amax = fmaxf(amax, fabsf(x[i]));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      for (int64_t i = 0; i < XB; ++i) {
        int v = i < n ? int(lrintf(x[i] * inv)) : 0;
        v = v > 127 ? 127 : (v < -127 ? -127 : v);
        ql[i] = int8_t(v);
      }
      c.dx[m * nb + b] = amax / 127.0f;
    }
}

// x [M, K] fp32 -> the int8 preset's codes (XCodes), split over the threads.
void quantize_x(const GemvArgs& a, int64_t Kq, const XCodes& c) {
  parallel_for(Kq / XB, 16, a.num_threads, [&](int64_t b0, int64_t b1) { code_blocks(a, Kq, c, b0, b1); });
}

// The span's scales for R rows: weight group scales d / mins m (natural channel order, m == nullptr: no min term
// in this span) and each row's activation scale dx and group sum sx.
template <int R>
struct SpanScales {
  const float* d;
  const float* m;
  float dx[R], sx[R];
};

#if defined(__AVX2__)
#if defined(PAGEMILL_I8_ZMM)
// Two pairs of k rows of the tile's 64 channels as 16-bit (k, k + 1) pairs -> the quad's panel bytes, as the
// unpacks leave them: zmm n, lane L holds channels 16 L + 4 n + {0..3} (the zmm panel order; a lane transpose of
// channel order, undone once per row at the end: no shuffle per quad).
inline void store_quads(__m512i a_lo, __m512i a_hi, __m512i b_lo, __m512i b_hi, uint8_t* out) {
  _mm512_storeu_si512(out, _mm512_unpacklo_epi16(a_lo, b_lo));
  _mm512_storeu_si512(out + 64, _mm512_unpackhi_epi16(a_lo, b_lo));
  _mm512_storeu_si512(out + 128, _mm512_unpacklo_epi16(a_hi, b_hi));
  _mm512_storeu_si512(out + 192, _mm512_unpackhi_epi16(a_hi, b_hi));
}

// v[n] lane L <- v[L] lane n: 64 channels between channel order and the zmm panel order (its own inverse).
inline void transpose_lanes(__m512 (&v)[4]) {
  const __m512 t0 = _mm512_shuffle_f32x4(v[0], v[1], 0x44), t1 = _mm512_shuffle_f32x4(v[0], v[1], 0xEE);
  const __m512 t2 = _mm512_shuffle_f32x4(v[2], v[3], 0x44), t3 = _mm512_shuffle_f32x4(v[2], v[3], 0xEE);
  v[0] = _mm512_shuffle_f32x4(t0, t2, 0x88), v[1] = _mm512_shuffle_f32x4(t0, t2, 0xDD);
  v[2] = _mm512_shuffle_f32x4(t1, t3, 0x88), v[3] = _mm512_shuffle_f32x4(t1, t3, 0xDD);
}

// The four vectors of v, lane-transposed, to out [64].
inline void store_transposed(__m512 (&v)[4], float* out) {
  transpose_lanes(v);
  for (int n = 0; n < 4; ++n) _mm512_storeu_ps(out + 16 * n, v[n]);
}

// Quad s of the panel from two pair rows (k, k + 1 in the low / high nibbles of each channel's byte) and, for B > 4
// bits, the B - 4 high-bit planes (`hr`: the plane row holding codes k .. k + 3 at bits j .. j + 3, `ps`: the
// planes' stride): codes 0 .. 2^B - 1, the unsigned operand of vpdpbusd (int32 sums: no 16-bit limit here).
template <int B = 4>
inline void quad_from_pairs(const uint8_t* pa, const uint8_t* pb, uint8_t* out, const uint8_t* hr = nullptr,
                            int64_t ps = 0, int j = 0) {
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512i ra = _mm512_loadu_si512(pa), rb = _mm512_loadu_si512(pb);
  __m512i c[4] = {_mm512_and_si512(ra, nib), _mm512_and_si512(_mm512_srli_epi16(ra, 4), nib),
                  _mm512_and_si512(rb, nib), _mm512_and_si512(_mm512_srli_epi16(rb, 4), nib)};
  for (int h = 0; h < B - 4; ++h) {
    const __m512i plane = _mm512_loadu_si512(hr + h * ps), bit = _mm512_set1_epi8(static_cast<char>(16 << h));
    for (int e = 0; e < 4; ++e)  // the bit is clear in c: a masked byte add is the masked or AVX-512BW lacks
      c[e] = _mm512_mask_add_epi8(c[e], _mm512_test_epi8_mask(plane, _mm512_set1_epi8(static_cast<char>(1 << (j + e)))),
                                  c[e], bit);
  }
  store_quads(_mm512_unpacklo_epi8(c[0], c[1]), _mm512_unpackhi_epi8(c[0], c[1]), _mm512_unpacklo_epi8(c[2], c[3]),
              _mm512_unpackhi_epi8(c[2], c[3]), out);
}

// Quad s of the panel from four int8 tile rows (k .. k + 3, NT bytes each).
inline void quad_from_rows(const int8_t* r, uint8_t* out) {
  __m512i v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm512_loadu_si512(r + i * NT);
  store_quads(_mm512_unpacklo_epi8(v[0], v[1]), _mm512_unpackhi_epi8(v[0], v[1]), _mm512_unpacklo_epi8(v[2], v[3]),
              _mm512_unpackhi_epi8(v[2], v[3]), out);
}
#else
// Two pairs of k rows of 32 channels as 16-bit (k, k + 1) pairs -> the quad's 4 panel vectors.
inline void store_quads(__m256i a_lo, __m256i a_hi, __m256i b_lo, __m256i b_hi, uint8_t* out) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_unpacklo_epi16(a_lo, b_lo));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + PV), _mm256_unpackhi_epi16(a_lo, b_lo));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * PV), _mm256_unpacklo_epi16(a_hi, b_hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 3 * PV), _mm256_unpackhi_epi16(a_hi, b_hi));
}

// Quad s of the panel from two pair rows (k, k + 1 in the low / high nibbles of each channel's byte).
inline void quad_from_pairs(const uint8_t* pa, const uint8_t* pb, uint8_t* out) {
  const __m256i nib = _mm256_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h) {
    const __m256i ra = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pa + 32 * h));
    const __m256i rb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + 32 * h));
    const __m256i la = _mm256_and_si256(ra, nib), ha = _mm256_and_si256(_mm256_srli_epi16(ra, 4), nib);
    const __m256i lb = _mm256_and_si256(rb, nib), hb = _mm256_and_si256(_mm256_srli_epi16(rb, 4), nib);
    store_quads(_mm256_unpacklo_epi8(la, ha), _mm256_unpackhi_epi8(la, ha), _mm256_unpacklo_epi8(lb, hb),
                _mm256_unpackhi_epi8(lb, hb), out + h * 4 * PV);
  }
}

// Quad s of the panel from four int8 tile rows (k .. k + 3, NT bytes each).
inline void quad_from_rows(const int8_t* r, uint8_t* out) {
  for (int h = 0; h < 2; ++h) {
    __m256i v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + i * NT + 32 * h));
    store_quads(_mm256_unpacklo_epi8(v[0], v[1]), _mm256_unpackhi_epi8(v[0], v[1]), _mm256_unpacklo_epi8(v[2], v[3]),
                _mm256_unpackhi_epi8(v[2], v[3]), out + h * 4 * PV);
  }
}

#endif

// acc += the dword dot products of weights w and activations x: unsigned w (4-bit codes; AVX2: 16-bit partial sums,
// widened by finish) or signed w (int8 tiles: 32-bit sums).
template <bool Signed>
struct Dot {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  static inline __m256i add(__m256i acc, __m256i w, __m256i x) {
    if constexpr (Signed) return _mm256_dpbusd_epi32(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
    return _mm256_dpbusd_epi32(acc, w, x);
  }
  static inline __m256i finish(__m256i acc) { return acc; }
#else
  static inline __m256i add(__m256i acc, __m256i w, __m256i x) {
    if constexpr (Signed)
      return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)),
                                                     _mm256_set1_epi16(1)));
    return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x));
  }
  static inline __m256i finish(__m256i acc) {
    if constexpr (Signed) return acc;
    return _mm256_madd_epi16(acc, _mm256_set1_epi16(1));
  }
#endif
};


// acc (R rows of NT floats, panel order: position (h * 4 + n) * 8 + 4 L + i is channel 32 h + 16 L + 4 n + i) +=
// the integer dot products of panel quads [s0, s1) with R rows of codes (xr[r] at the span's first k), scaled.
template <int R, bool Signed>
inline void span_dot(const uint8_t* panel, int64_t s0, int64_t s1, int h, const int8_t* const* xr,
                     const SpanScales<R>& sc, float* acc_out) {
  __m256i acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < 4; ++n) acc[r][n] = _mm256_setzero_si256();
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* pv = panel + (s * 2 + h) * 4 * PV;
    __m256i xb[R];
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      memcpy(&quad, xr[r] + 4 * (s - s0), 4);
      xb[r] = _mm256_set1_epi32(quad);
    }
    for (int n = 0; n < 4; ++n) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pv + n * PV));
      for (int r = 0; r < R; ++r) acc[r][n] = Dot<Signed>::add(acc[r][n], w, xb[r]);
    }
  }
  for (int n = 0; n < 4; ++n) {
    const int64_t c = 32 * h + 4 * n;
    const __m256 d = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(sc.d + c)), _mm_loadu_ps(sc.d + c + 16), 1);
    const __m256 m = sc.m ? _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(sc.m + c)),
                                                 _mm_loadu_ps(sc.m + c + 16), 1)
                          : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
      float* a = acc_out + r * NT + (h * 4 + n) * 8;
      __m256 y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Dot<Signed>::finish(acc[r][n])),
                                 _mm256_mul_ps(d, _mm256_set1_ps(sc.dx[r])), _mm256_loadu_ps(a));
      if (sc.m) y = _mm256_fmadd_ps(m, _mm256_set1_ps(sc.sx[r]), y);
      _mm256_storeu_ps(a, y);
    }
  }
}

// A row of accumulators from panel order to channel order.
inline void channel_order(const float* in, float* out) {
  for (int64_t p = 0; p < NT; ++p) {
    const int64_t hn = p / 8, h = hn / 4, n = hn % 4, L = (p % 8) / 4, i = p % 4;
    out[32 * h + 16 * L + 4 * n + i] = in[p];
  }
}

#if defined(PAGEMILL_I8_ZMM)
// A row of accumulators from the zmm panel order to channel order.
inline void channel_order_zmm(const float* in, float* out) {
  __m512 v[4];
  for (int n = 0; n < 4; ++n) v[n] = _mm512_loadu_ps(in + 16 * n);
  store_transposed(v, out);
}

// One panel vector j of a quad against R rows' broadcast codes (assembler text for quad_loop below).
#define PAGEMILL_QUAD_VEC(j, ROWS) "vmovdqu64 " #j "*64(%[p]), %%zmm31\n\t" ROWS(j)
#define PAGEMILL_ROWS1(j) "vpdpbusd %%zmm28, %%zmm31, %[a0" #j "]\n\t"
#define PAGEMILL_ROWS2(j) PAGEMILL_ROWS1(j) "vpdpbusd %%zmm29, %%zmm31, %[a1" #j "]\n\t"
#define PAGEMILL_ROWS3(j) PAGEMILL_ROWS2(j) "vpdpbusd %%zmm30, %%zmm31, %[a2" #j "]\n\t"
#define PAGEMILL_QUAD(ROWS) \
  PAGEMILL_QUAD_VEC(0, ROWS) PAGEMILL_QUAD_VEC(1, ROWS) PAGEMILL_QUAD_VEC(2, ROWS) PAGEMILL_QUAD_VEC(3, ROWS)
#define PAGEMILL_ACC(r) \
  [a##r##0] "+v"(acc[r][0]), [a##r##1] "+v"(acc[r][1]), [a##r##2] "+v"(acc[r][2]), [a##r##3] "+v"(acc[r][3])
#define PAGEMILL_QUAD_LOOP(BROADCASTS, ROWS) \
  "1:\n\t" BROADCASTS PAGEMILL_QUAD(ROWS) "add $256, %[p]\n\tadd $4, %[x]\n\tcmp %[end], %[p]\n\tjne 1b"

// acc[r][j] += the products of nq panel quads from p (unsigned codes) with row r's codes (xr[r] + 4 q0 on, the
// rows Kq bytes apart), in assembly: with the loop in C++, GCC 12 reloaded each weight vector for every row (15
// 512-bit loads per 12 products: the two load ports, not the multiplier, bounded the loop) or spilled a broadcast
// when the loops were swapped. zmm28-30 hold the rows' codes, zmm31 the weights (GCC allows 30 operands).
template <int R>
inline void quad_loop(const uint8_t* p, const int8_t* const* xr, int64_t q0, int64_t nq, __m512i (&acc)[R][4]) {
  const int8_t* x = xr[0] + 4 * q0;
  const int64_t xs = R > 1 ? xr[1] - xr[0] : 0;
  const uint8_t* end = p + nq * 8 * PV;
  if constexpr (R == 3) {
    asm(PAGEMILL_QUAD_LOOP("vpbroadcastd (%[x]), %%zmm28\n\tvpbroadcastd (%[x],%[xs],1), %%zmm29\n\t"
                           "vpbroadcastd (%[x],%[xs],2), %%zmm30\n\t", PAGEMILL_ROWS3)
        : PAGEMILL_ACC(0), PAGEMILL_ACC(1), PAGEMILL_ACC(2), [p] "+r"(p), [x] "+r"(x)
        : [end] "r"(end), [xs] "r"(xs)
        : "xmm28", "xmm29", "xmm30", "xmm31", "memory", "cc");
  } else if constexpr (R == 2) {
    asm(PAGEMILL_QUAD_LOOP("vpbroadcastd (%[x]), %%zmm28\n\tvpbroadcastd (%[x],%[xs],1), %%zmm29\n\t",
                           PAGEMILL_ROWS2)
        : PAGEMILL_ACC(0), PAGEMILL_ACC(1), [p] "+r"(p), [x] "+r"(x)
        : [end] "r"(end), [xs] "r"(xs)
        : "xmm28", "xmm29", "xmm31", "memory", "cc");
  } else {
    asm(PAGEMILL_QUAD_LOOP("vpbroadcastd (%[x]), %%zmm28\n\t", PAGEMILL_ROWS1)
        : PAGEMILL_ACC(0), [p] "+r"(p), [x] "+r"(x)
        : [end] "r"(end)
        : "xmm28", "xmm31", "memory", "cc");
  }
}
#undef PAGEMILL_QUAD_LOOP
#undef PAGEMILL_QUAD_VEC
#undef PAGEMILL_ROWS1
#undef PAGEMILL_ROWS2
#undef PAGEMILL_ROWS3
#undef PAGEMILL_QUAD
#undef PAGEMILL_ACC

// A whole k block [k0, k0 + nspan SP) for R rows: zmm j of a quad holds channels 16 L + 4 j + {0..3} in lane L (the
// zmm panel order), so the accumulators, and the group scales d / m given in that order ([groups of the block][NT]),
// are plain zmm at 16 j. The sums stay in registers over the block (R = 3: 12 float + 12 integer accumulators);
// xr / dxr / sxr: each row's codes at k0, activation scales at k0 / XB and group sums at k0 / G.
template <int R, bool Signed>
inline void kblock_dot_zmm(const uint8_t* panel, int64_t nspan, int64_t SP, int64_t G, const int8_t* const* xr,
                           const float* const* dxr, const float* const* sxr,
                           const float* d, const float* m, float* acc_out) {
  __m512 y[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) y[r][j] = _mm512_loadu_ps(acc_out + r * NT + 16 * j);
  const int64_t spans_per_group = G / SP;  // (SP = min(G, XB) divides G)
  for (int64_t sp = 0, gl = 0, c = 0; sp < nspan; ++sp) {  // gl: the span's group within the block, c: its place
    const int64_t ks = sp * SP, q0 = ks / 4;
    __m512i acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_si512();
    if constexpr (!Signed) {
      quad_loop<R>(panel + q0 * 8 * PV, xr, q0, SP / 4, acc);
    } else {
      for (int64_t q = q0; q < q0 + SP / 4; ++q) {
        const uint8_t* pv = panel + q * 8 * PV;
        __m512i w[4];
        __mmask64 neg[4];
        for (int j = 0; j < 4; ++j) {  // |w| unsigned, x carrying w's sign
          w[j] = _mm512_loadu_si512(pv + 64 * j);
          neg[j] = _mm512_movepi8_mask(w[j]);
          w[j] = _mm512_abs_epi8(w[j]);
        }
        for (int r = 0; r < R; ++r) {
          int32_t quad;
          memcpy(&quad, xr[r] + 4 * q, 4);
          const __m512i xb = _mm512_set1_epi32(quad);
          for (int j = 0; j < 4; ++j)
            acc[r][j] = dpbusd(acc[r][j], w[j], _mm512_mask_sub_epi8(xb, neg[j], _mm512_setzero_si512(), xb));
        }
      }
    }
    const float* dg = d + gl * NT;
    for (int j = 0; j < 4; ++j) {
      const __m512 dj = _mm512_loadu_ps(dg + 16 * j);
      for (int r = 0; r < R; ++r)
        y[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][j]), _mm512_mul_ps(dj, _mm512_set1_ps(dxr[r][ks / XB])),
                                  y[r][j]);
    }
    if (m != nullptr && c == 0) {
      const float* mg = m + gl * NT;
      for (int j = 0; j < 4; ++j) {
        const __m512 mj = _mm512_loadu_ps(mg + 16 * j);
        for (int r = 0; r < R; ++r) y[r][j] = _mm512_fmadd_ps(mj, _mm512_set1_ps(sxr[r][gl]), y[r][j]);
      }
    }
    if (++c == spans_per_group) c = 0, ++gl;
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc_out + r * NT + 16 * j, y[r][j]);
}

// ----------------------------------------------------------------------------------------------------------------
// Integer-scaled super-blocks (Q4_K and Q6_K with VNNI; llama.cpp's Q8_K scheme). x is quantized per row and
// super-block of XS = 256 k (one scale dx), so each group's integer sums, times the group's integer sub-scale, add
// up in int32 over the super-block: one int multiply and add per group and accumulator instead of the float epilogue
// (convert, scale, add, min) per group. The correction terms come from the codes' sums in integers too:
//   Q4_K (w = D sc q - Dmin mn):   y += dx D isum - dx Dmin sum_g mn_g s32_g    (s32_g: the sum of x's codes in g)
//   Q6_K (w = D sc (q - 32)):      y += dx D (isum - 32 sum_g sc_g s16_g)
// with isum = sum_g sc_g * (the integer sums of group g). Integers are exact in any order, so the 1-3 row kernel
// (quads built in registers) and the panel path give each row the same bits. Largest |isum|: Q6_K 16 groups x 16
// x 63 x 127 x 127 < 2^29, Q4_K 8 x 32 x 15 x 127 x 63 < 2^25.
constexpr int64_t XS = 256;

// x's codes for the integer-scaled super-blocks: q [M, Kq], one scale per row and super-block dx [M, Kq / XS], and
// the codes' sums per 16 and per 32 as int16 (sum16 [M, Kq / 16], sum32 [M, Kq / 32]; |sum| <= 32 x 127).
struct SuperCodes {
  int8_t* q;
  float* dx;
  int16_t* sum16;
  int16_t* sum32;
};

// Super-blocks [b0, b1) of every row's codes: round to nearest even of x * 127 / max|x|, as code_blocks rounds.
void code_superblocks(const GemvArgs& a, int64_t Kq, const SuperCodes& c, int64_t b0, int64_t b1) {
  const int64_t K = a.K, nb = Kq / XS;
  const __m512i lim = _mm512_set1_epi32(127), nlim = _mm512_set1_epi32(-127), bias = _mm512_set1_epi8(-128);
  for (int64_t m = 0; m < a.M; ++m)
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t k0 = b * XS, n = imax(0, imin(XS, K - k0));
      const float* x = a.x + m * K + k0;
      __m512 v[XS / 16], amax = _mm512_setzero_ps();
      for (int i = 0; i < XS / 16; ++i) {
        const int64_t left = n - 16 * i;
        const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
        v[i] = _mm512_maskz_loadu_ps(mask, x + 16 * i);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
      }
      const float mx = _mm512_reduce_max_ps(amax);
      const __m512 inv = _mm512_set1_ps(mx > 0.0f ? 127.0f / mx : 0.0f);
      int8_t* q = c.q + m * Kq + k0;
      int16_t* s16 = c.sum16 + m * (Kq / 16) + k0 / 16;
      int16_t* s32 = c.sum32 + m * (Kq / 32) + k0 / 32;
      for (int i = 0; i < XS / 16; ++i) {
        const __m512i qi = _mm512_min_epi32(lim, _mm512_max_epi32(nlim, _mm512_cvtps_epi32(_mm512_mul_ps(v[i], inv))));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * i), _mm512_cvtepi32_epi8(qi));
      }
      for (int i = 0; i < XS / 64; ++i) {  // psadbw of the codes + 128: sums of 8
        alignas(64) int64_t s8[8];
        _mm512_store_si512(s8, _mm512_sad_epu8(_mm512_xor_si512(_mm512_loadu_si512(q + 64 * i), bias),
                                               _mm512_setzero_si512()));
        for (int j = 0; j < 4; ++j) s16[4 * i + j] = int16_t(s8[2 * j] + s8[2 * j + 1] - 16 * 128);
      }
      for (int i = 0; i < XS / 32; ++i) s32[i] = int16_t(s16[2 * i] + s16[2 * i + 1]);
      c.dx[m * nb + b] = mx / 127.0f;
    }
}

// x [M, K] fp32 -> SuperCodes (buffers for M rows of Kq = round_up(K, XS)), split over the threads.
struct SuperCodeBuffers {
  Scratch q_buf, dx_buf, s16_buf, s32_buf;
  SuperCodes get(const GemvArgs& a, int64_t Kq) {
    const SuperCodes c{reinterpret_cast<int8_t*>(q_buf.get((a.M * Kq + 3) / 4)), dx_buf.get(a.M * (Kq / XS)),
                       reinterpret_cast<int16_t*>(s16_buf.get((a.M * (Kq / 16) + 1) / 2)),
                       reinterpret_cast<int16_t*>(s32_buf.get((a.M * (Kq / 32) + 1) / 2))};
    parallel_for(Kq / XS, 2, a.num_threads, [&](int64_t b0, int64_t b1) { code_superblocks(a, Kq, c, b0, b1); });
    return c;
  }
};

// The integer-scaled formats: group size and whether the correction is a min (Q4_K) or the code offset (Q6_K).
template <class S>
struct Super {
  static constexpr bool value = false;
};
template <>
struct Super<KScales<4, 8>> {
  static constexpr bool value = true, kMin = true;
  static constexpr int64_t G = 32;
};
template <>
struct Super<SubScales<6, 32>> {
  static constexpr bool value = true, kMin = false;
  static constexpr int64_t G = 16;
  static constexpr int kOffset = 32;
};

// A super-block record's scales in the zmm panel order: the integer sub-scales sc [groups][NT], the correction's
// int16 pairs [groups / 2][NT] (groups 2 i, 2 i + 1: Q4_K's mins, Q6_K's sub-scales), D and Dmin [NT].
struct SuperScales {
  alignas(64) int32_t sc[16 * NT];
  alignas(64) int32_t pairs[8 * NT];
  alignas(64) float d[NT];
  alignas(64) float dmin[NT];
};

// 64 bytes in channel order -> int32 in the zmm panel order (v[n] lane L dword i: channel 16 L + 4 n + i).
template <bool Signed>
inline void panel_ints(const uint8_t* row, __m512i (&v)[4]) {
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i g = _mm512_permutexvar_epi32(idx, _mm512_loadu_si512(row));  // lane n: dwords 4 L + n
  const __m128i b[4] = {_mm512_castsi512_si128(g), _mm512_extracti32x4_epi32(g, 1), _mm512_extracti32x4_epi32(g, 2),
                        _mm512_extracti32x4_epi32(g, 3)};
  for (int n = 0; n < 4; ++n) v[n] = Signed ? _mm512_cvtepi8_epi32(b[n]) : _mm512_cvtepu8_epi32(b[n]);
}

// NT fp16 in channel order -> float in the zmm panel order.
inline void panel_floats(const uint8_t* row, float* out) {
  __m512 v[4];
  for (int n = 0; n < 4; ++n)
    v[n] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * n)));
  store_transposed(v, out);
}

// Scale section s of a Q4_K (D, Dmin fp16, sc, mn uint8) or Q6_K (D fp16, sc int8) record -> out.
template <class S>
void super_scales(const uint8_t* s, SuperScales& out) {
  constexpr bool kMin = Super<S>::kMin;
  panel_floats(s, out.d);
  if constexpr (kMin) panel_floats(s + 2 * NT, out.dmin);
  const uint8_t* sc = s + (kMin ? 4 : 2) * NT;
  const uint8_t* corr = kMin ? sc + S::GR * NT : sc;
  for (int g = 0; g < S::GR; ++g) {
    __m512i v[4];
    panel_ints<!kMin>(sc + g * NT, v);
    for (int n = 0; n < 4; ++n) _mm512_store_si512(out.sc + g * NT + 16 * n, v[n]);
  }
  const __m512i low = _mm512_set1_epi32(0xFFFF);
  for (int i = 0; i < S::GR / 2; ++i) {
    __m512i lo[4], hi[4];
    panel_ints<!kMin>(corr + 2 * i * NT, lo), panel_ints<!kMin>(corr + (2 * i + 1) * NT, hi);
    for (int n = 0; n < 4; ++n)
      _mm512_store_si512(out.pairs + i * NT + 16 * n,
                         _mm512_or_si512(_mm512_and_si512(lo[n], low), _mm512_slli_epi32(hi[n], 16)));
  }
}

// isum[r][n] += sc_g * acc[r][n] for group g of the super-block.
template <int R>
inline void add_scaled(__m512i (&isum)[R][4], const __m512i (&acc)[R][4], const SuperScales& ss, int64_t g) {
  for (int n = 0; n < 4; ++n) {
    const __m512i s = _mm512_load_si512(ss.sc + g * NT + 16 * n);
    for (int r = 0; r < R; ++r) isum[r][n] = _mm512_add_epi32(isum[r][n], _mm512_mullo_epi32(acc[r][n], s));
  }
}

// The end of a super-block for R rows: y (panel order, R x NT) += the float result of isum and the correction from
// each row's int16 pairs of code sums xp[r] (Q4_K: per 32, Q6_K: per 16) and scale dx[r].
template <class S, int R>
inline void super_finish(const __m512i (&isum)[R][4], const int32_t* const* xp, const float* dx,
                         const SuperScales& ss, float* y) {
  __m512i csum[R][4];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < 4; ++n) csum[r][n] = _mm512_setzero_si512();
  for (int i = 0; i < S::GR / 2; ++i)
    for (int n = 0; n < 4; ++n) {
      const __m512i p = _mm512_load_si512(ss.pairs + i * NT + 16 * n);
      for (int r = 0; r < R; ++r) csum[r][n] = _mm512_dpwssd_epi32(csum[r][n], p, _mm512_set1_epi32(xp[r][i]));
    }
  for (int n = 0; n < 4; ++n) {
    const __m512 d = _mm512_load_ps(ss.d + 16 * n);
    for (int r = 0; r < R; ++r) {
      const __m512 dxr = _mm512_set1_ps(dx[r]);
      float* yv = y + r * NT + 16 * n;
      if constexpr (Super<S>::kMin) {
        const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][n]), _mm512_mul_ps(d, dxr), _mm512_loadu_ps(yv));
        _mm512_storeu_ps(yv, _mm512_fnmadd_ps(_mm512_cvtepi32_ps(csum[r][n]),
                                              _mm512_mul_ps(_mm512_load_ps(ss.dmin + 16 * n), dxr), v));
      } else {
        const __m512i net = _mm512_sub_epi32(isum[r][n], _mm512_mullo_epi32(csum[r][n],
                                                                           _mm512_set1_epi32(Super<S>::kOffset)));
        _mm512_storeu_ps(yv, _mm512_fmadd_ps(_mm512_cvtepi32_ps(net), _mm512_mul_ps(d, dxr), _mm512_loadu_ps(yv)));
      }
    }
  }
}

// A k block of the panel that is one whole super-block, for R rows (codes xr[r] at its first k).
template <class S, int R>
inline void superblock_dot_zmm(const uint8_t* panel, const int8_t* const* xr, const int32_t* const* xp,
                               const float* dx, const SuperScales& ss, float* acc_out) {
  constexpr int64_t G = Super<S>::G;
  __m512i isum[R][4];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < 4; ++n) isum[r][n] = _mm512_setzero_si512();
  for (int64_t g = 0; g < XS / G; ++g) {
    __m512i acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int n = 0; n < 4; ++n) acc[r][n] = _mm512_setzero_si512();
    quad_loop<R>(panel + g * G / 4 * 8 * PV, xr, g * G / 4, G / 4, acc);
    add_scaled<R>(isum, acc, ss, g);
  }
  super_finish<S, R>(isum, xp, dx, ss, acc_out);
}
#endif
#else
// Portable forms of the same panel and products.
inline int64_t panel_channel(int n, int byte) { return 16 * (byte / 16) + 4 * n + (byte / 4) % 4; }

inline void quad_from_pairs(const uint8_t* pa, const uint8_t* pb, uint8_t* out) {
  for (int h = 0; h < 2; ++h)
    for (int n = 0; n < 4; ++n)
      for (int b = 0; b < 32; b += 4) {
        const int64_t c = 32 * h + panel_channel(n, b);
        uint8_t* o = out + (h * 4 + n) * PV + b;
        o[0] = pa[c] & 15, o[1] = pa[c] >> 4, o[2] = pb[c] & 15, o[3] = pb[c] >> 4;
      }
}

inline void quad_from_rows(const int8_t* r, uint8_t* out) {
  for (int h = 0; h < 2; ++h)
    for (int n = 0; n < 4; ++n)
      for (int b = 0; b < 32; b += 4) {
        const int64_t c = 32 * h + panel_channel(n, b);
        uint8_t* o = out + (h * 4 + n) * PV + b;
        for (int i = 0; i < 4; ++i) o[i] = uint8_t(r[i * NT + c]);
      }
}

template <int R, bool Signed>
inline void span_dot(const uint8_t* panel, int64_t s0, int64_t s1, int h, const int8_t* const* xr,
                     const SpanScales<R>& sc, float* acc_out) {
  int32_t acc[R][32] = {};
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* pv = panel + (s * 2 + h) * 4 * PV;
    for (int r = 0; r < R; ++r) {
      const int8_t* x4 = xr[r] + 4 * (s - s0);
      for (int n = 0; n < 4; ++n)
        for (int b = 0; b < 32; b += 4) {
          int32_t d = 0;
          for (int i = 0; i < 4; ++i) {
            const int32_t w = Signed ? int32_t(int8_t(pv[n * PV + b + i])) : int32_t(pv[n * PV + b + i]);
            d += w * int32_t(x4[i]);
          }
          acc[r][panel_channel(n, b)] += d;
        }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 32; ++c) {
      const int64_t ch = 32 * h + c;
      float y = acc_out[r * NT + ch] + float(acc[r][c]) * (sc.d[ch] * sc.dx[r]);
      if (sc.m) y += sc.m[ch] * sc.sx[r];
      acc_out[r * NT + ch] = y;
    }
}

inline void channel_order(const float* in, float* out) { memcpy(out, in, sizeof(float) * NT); }
#endif

// The scales of weight group g of tile t: y += fsum * d * dx + m * sx (m == nullptr source: no min term).
struct TileScales {
  const float* scales;
  const float* mins;
  int64_t ng;
  inline vf d(int64_t t, int64_t g, int v) const { return vload(scales + (t * ng + g) * NT + v * W); }
  inline bool has_min() const { return mins != nullptr; }
  inline vf m(int64_t t, int64_t g, int v) const { return vload(mins + (t * ng + g) * NT + v * W); }
};

template <class S>
struct RecordScales {
  const uint8_t* packed;
  int64_t G, tile_bytes;
  inline const uint8_t* section(int64_t t, int64_t g) const {
    return packed + t * tile_bytes + g / S::GR * record_bytes<S>(G) + S::GR * group_bytes<S>(G);
  }
  inline vf d(int64_t t, int64_t g, int v) const { return S::d(section(t, g), int(g % S::GR), v); }
  inline bool has_min() const { return true; }
  inline vf m(int64_t t, int64_t g, int v) const { return S::m(section(t, g), int(g % S::GR), v); }
};

// A thread's buffers for the panel paths: accumulators (panel order), a tile's outputs (channel order), the panel
// and the k block's scales.
struct PanelScratch {
  Scratch acc, out, panel, scale;
};

// Tiles shared between the threads as run_panel shares them (gemv.cpp): whole tiles per thread, the leftover tiles
// split by rows; tile_rows(scratch, t, r0, r1) computes rows [r0, r1) of tile t.
template <class TileRows>
void share_tiles(const GemvArgs& a, const TileRows& tile_rows) {
  const int64_t M = a.M;
  const int64_t threads = omp_in_parallel() ? 1 : imax(1, imin(a.num_threads, a.tiles * M));
  const int64_t whole = M >= RMAX * threads ? a.tiles - a.tiles % threads : a.tiles;
  parallel_for(threads, 1, int(threads), [&](int64_t i0, int64_t i1) {
    PanelScratch scratch;
    for (int64_t i = i0; i < i1; ++i) {
      for (int64_t t = whole * i / threads; t < whole * (i + 1) / threads; ++t) tile_rows(scratch, t, 0, M);
      for (int64_t t = whole; t < a.tiles; ++t) {
        const int64_t r0 = M * i / threads, r1 = M * (i + 1) / threads;
        if (r0 < r1) tile_rows(scratch, t, r0, r1);
      }
    }
  });
}

// y = x W^T + b for every row: `build(t, k0, k1, panel)` lays out tile t's rows [k0, k1) (whole groups of G),
// `sc` gives the group scales. Kw: the weights' K (>= a.K; x is zero beyond a.K). Tile t's weights are the
// tile_bytes from weights + t tile_bytes, in k order: the next k block's are prefetched while one is computed (at 32
// rows, a 1B model's records otherwise stalled the panel builds on DRAM for a fifth of the time).
template <bool Signed, class Build, class Scales>
void run_i8(const GemvArgs& a, int64_t Kw, int64_t G, const void* weights, int64_t tile_bytes, Build build,
            const Scales& sc) {
  const int64_t M = a.M, Kq = round_up(Kw, XB), nb = Kq / XB, ng = Kw / G, SP = imin(G, XB);
  Scratch q_buf, dx_buf, sx_buf;
  const XCodes xc{reinterpret_cast<int8_t*>(q_buf.get((M * Kq + 3) / 4)), dx_buf.get(M * nb)};
  const int8_t* xq = xc.q;
  const float* dx = xc.dx;
  const bool min_term = sc.has_min();
  quantize_x(a, Kq, xc);
  float* sx = nullptr;
  if (min_term) {
    sx = sx_buf.get(M * ng);
    group_sums(a, G, ng, sx);
  }
  const int64_t gpb = KBI / G;
  share_tiles(a, [&](PanelScratch& s, int64_t t, int64_t r0, int64_t r1) {
    uint8_t* panel = reinterpret_cast<uint8_t*>(s.panel.get(KBI / 4 * 8 * PV / 4));
    float* dbuf = s.scale.get(2 * gpb * NT);  // the k block's group scales d, then mins m [gpb, NT]
    float* mbuf = dbuf + gpb * NT;
    const int64_t Mr = r1 - r0, nblk = (Mr + RMAX - 1) / RMAX, base = Mr / nblk, extra = Mr % nblk;
    float* acc = s.acc.get(Mr * NT);  // panel order
    float* out = s.out.get(Mr * NT);  // channel order
    memset(acc, 0, sizeof(float) * Mr * NT);
    for (int64_t k0 = 0; k0 < Kw; k0 += KBI) {
      const int64_t k1 = imin(k0 + KBI, Kw), g0 = k0 / G;
      build(t, k0, k1, panel);
      const NextBlock next(weights, tile_bytes, Kw, a.tiles, t, k1, KBI);
#if defined(PAGEMILL_I8_ZMM)
      // the k block's scales in the zmm panel order
      for (int64_t g = g0; g < k1 / G; ++g) {
        __m512 v[4];
        for (int n = 0; n < 4; ++n) v[n] = sc.d(t, g, n);
        store_transposed(v, dbuf + (g - g0) * NT);
        if (min_term) {
          for (int n = 0; n < 4; ++n) v[n] = sc.m(t, g, n);
          store_transposed(v, mbuf + (g - g0) * NT);
        }
      }
      for (int64_t i = 0, m0 = 0; i < nblk; ++i) {
        const int R = int(base + (i < extra));
        const int8_t* xr[RMAX];
        const float* dxr[RMAX];
        const float* sxr[RMAX];
        for (int r = 0; r < R; ++r) {
          const int64_t row = r0 + m0 + r;
          xr[r] = xq + row * Kq + k0;
          dxr[r] = dx + row * nb + k0 / XB;
          sxr[r] = min_term ? sx + row * ng + g0 : nullptr;
        }
        next.slice(i, nblk);
        with_static_count<RMAX>(R, [&](auto rc) {
          kblock_dot_zmm<decltype(rc)::value, Signed>(panel, (k1 - k0) / SP, SP, G, xr, dxr, sxr,
                                                              dbuf, min_term ? mbuf : nullptr, acc + m0 * NT);
        });
        m0 += R;
      }
#else
      for (int64_t g = g0; g < k1 / G; ++g)
        for (int v = 0; v < NV; ++v) {
          vstore(dbuf + (g - g0) * NT + v * W, sc.d(t, g, v));
          if (sc.has_min()) vstore(mbuf + (g - g0) * NT + v * W, sc.m(t, g, v));
        }
      for (int64_t i = 0, m0 = 0; i < nblk; ++i) {
        const int R = int(base + (i < extra));
        next.slice(i, nblk);
        for (int64_t ks = k0; ks < k1; ks += SP) {
          const int64_t g = ks / G;
          const bool span_min = sc.has_min() && ks % G == 0;
          const int8_t* xr[RMAX];
          for (int r = 0; r < R; ++r) xr[r] = xq + (r0 + m0 + r) * Kq + ks;
          with_static_count<RMAX>(R, [&](auto rc) {
            constexpr int RC = decltype(rc)::value;
            SpanScales<RC> ss{dbuf + (g - g0) * NT, span_min ? mbuf + (g - g0) * NT : nullptr, {}, {}};
            for (int r = 0; r < RC; ++r) {
              ss.dx[r] = dx[(r0 + m0 + r) * nb + ks / XB];
              ss.sx[r] = span_min ? sx[(r0 + m0 + r) * ng + g] : 0.0f;
            }
            for (int h = 0; h < 2; ++h)
              span_dot<RC, Signed>(panel, (ks - k0) / 4, (ks - k0 + SP) / 4, h, xr, ss, acc + m0 * NT);
          });
        }
        m0 += R;
      }
#endif
    }
#if defined(PAGEMILL_I8_ZMM)
    for (int64_t m = 0; m < Mr; ++m) channel_order_zmm(acc + m * NT, out + m * NT);
#else
    for (int64_t m = 0; m < Mr; ++m) channel_order(acc + m * NT, out + m * NT);
#endif
    store_tile(row_chunk(a, r0, Mr), out, t);
  });
}

#if defined(PAGEMILL_I8_ZMM)
// The integer-scaled panel path (Q4_K / Q6_K: Super): every k block is one super-block, laid out by `build` as for
// run_i8 and multiplied by x's super-block codes.
template <class S, class Build>
void run_i8_super(const GemvArgs& a, const uint8_t* packed, Build build) {
  constexpr int64_t G = Super<S>::G;
  const int64_t K = a.K, Kq = round_up(K, XS), nb = Kq / XS, tile_bytes = K / G / S::GR * record_bytes<S>(G);
  SuperCodeBuffers buffers;
  const SuperCodes xc = buffers.get(a, Kq);
  const int16_t* sums = Super<S>::kMin ? xc.sum32 : xc.sum16;  // the correction's code sums: per group
  const int64_t sum_stride = Kq / G;
  share_tiles(a, [&](PanelScratch& s, int64_t t, int64_t r0, int64_t r1) {
    uint8_t* panel = reinterpret_cast<uint8_t*>(s.panel.get(KBI / 4 * 8 * PV / 4));
    SuperScales& ss = *reinterpret_cast<SuperScales*>(s.scale.get(sizeof(SuperScales) / sizeof(float)));
    const int64_t Mr = r1 - r0, nblk = (Mr + RMAX - 1) / RMAX, base = Mr / nblk, extra = Mr % nblk;
    float* acc = s.acc.get(Mr * NT);  // panel order
    float* out = s.out.get(Mr * NT);  // channel order
    memset(acc, 0, sizeof(float) * Mr * NT);
    const uint8_t* rec = packed + t * tile_bytes;
    for (int64_t k0 = 0; k0 < K; k0 += XS) {
      build(t, k0, k0 + XS, panel);
      const NextBlock next(packed, tile_bytes, K, a.tiles, t, k0 + XS, XS);
      super_scales<S>(rec + k0 / XS * record_bytes<S>(G) + S::GR * group_bytes<S>(G), ss);
      for (int64_t i = 0, m0 = 0; i < nblk; ++i) {
        const int R = int(base + (i < extra));
        const int8_t* xr[RMAX];
        const int32_t* xp[RMAX];
        float dx[RMAX];
        for (int r = 0; r < R; ++r) {
          const int64_t row = r0 + m0 + r;
          xr[r] = xc.q + row * Kq + k0;
          xp[r] = reinterpret_cast<const int32_t*>(sums + row * sum_stride + k0 / G);
          dx[r] = xc.dx[row * nb + k0 / XS];
        }
        next.slice(i, nblk);
        with_static_count<RMAX>(R, [&](auto rc) {
          superblock_dot_zmm<S, decltype(rc)::value>(panel, xr, xp, dx, ss, acc + m0 * NT);
        });
        m0 += R;
      }
    }
    for (int64_t m = 0; m < Mr; ++m) channel_order_zmm(acc + m * NT, out + m * NT);
    store_tile(row_chunk(a, r0, Mr), out, t);
  });
}
#endif

template <class S>
void records_i8(const GemvArgs& a, const uint8_t* packed, int64_t G) {
  const int64_t ng = a.K / G, tile_bytes = ng / S::GR * record_bytes<S>(G);
  const auto build = [&](int64_t t, int64_t k0, int64_t k1, uint8_t* panel) {
    const uint8_t* rec = packed + t * tile_bytes;
    for (int64_t g = k0 / G; g < k1 / G; ++g) {
      const uint8_t* p = rec + g / S::GR * record_bytes<S>(G) + (g % S::GR) * group_bytes<S>(G);
      for (int64_t q = 0; q < G / 4; ++q) {
        uint8_t* out = panel + ((g * G - k0) / 4 + q) * 8 * PV;
        if constexpr (S::B == 4) {
          quad_from_pairs(p + 2 * q * NT, p + (2 * q + 1) * NT, out);
        } else {
#if defined(PAGEMILL_I8_ZMM)  // codes k = 4 q .. 4 q + 3: plane row k / 8, bits k % 8
          quad_from_pairs<S::B>(p + 2 * q * NT, p + (2 * q + 1) * NT, out, p + G / 2 * NT + (q / 2) * NT,
                                G / 8 * NT, int(4 * q % 8));
#endif
        }
      }
    }
  };
#if defined(PAGEMILL_I8_ZMM)
  if constexpr (Super<S>::value)
    run_i8_super<S>(a, packed, build);
  else
#endif
    run_i8<false>(a, a.K, G, packed, tile_bytes, build, RecordScales<S>{packed, G, tile_bytes});
}


// ----------------------------------------------------------------------------------------------------------------
// Decode (M <= kDecodeRows): no panel. Each pair of pair rows is turned into quad vectors in registers and multiplied
// at once by up to three streams of int8 codes: the rows of x (linear_dtype="int8": one level, the quantization
// above), or, for the exact float32 default on AVX2, the three levels of one row:
//   x = s1 q1 + s2 q2 + s3 q3 + r,  s_{l+1} = s_l / 254,  |r| <= s3 / 2 = max|x| / (2 * 127 * 254^2) ~ 6.1e-8 max|x|
// per block of 32: float32 rounding of the block's largest value, so the sums are those of the float kernel up to
// fp32 noise, at about half the instructions per weight of the float unpack (AVX-512 keeps its float kernel, faster).
constexpr int64_t kDecodeRows = 3;

#if defined(__AVX2__)
// Pair rows are multiplied as they are stored: a byte unpack of a pair row's low and high nibbles puts each channel's
// (k, k + 1) codes side by side, so maddubs with a broadcast (x[k], x[k + 1]) gives that channel's 16-bit partial sum
// (no quad shuffles, channels in natural order within 8-lane chunks). 16-bit sums hold 8 pair rows: 8 * 2 * 15 * 127
// < 2^15.
constexpr int64_t kPairRowsPer16 = 8;

// Streams j < J over `rows` (<= 8) pair rows from p, half h of the tile (32 channels): the int32 sums of channels
// 32 h + {0..7, 16..23} (out[j][0], out[j][1]) and {8..15, 24..31} (out[j][2], out[j][3]). xp[j]: the stream's code
// pairs as dwords (x[k], x[k + 1], x[k], x[k + 1]) at the first pair row.
template <int J>
inline void pair_dot(const uint8_t* p, int64_t rows, int h, const int32_t* const* xp, __m256i out[J][4]) {
  const __m256i nib = _mm256_set1_epi8(0x0F);
  __m256i acc[J][2];
  for (int j = 0; j < J; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_si256();
  for (int64_t i = 0; i < rows; ++i) {
    const uint8_t* pr = p + i * NT + 32 * h;
    if (h == 0) prefetch_l1(pr + 2048), prefetch_l2(pr + 16384);
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pr));
    const __m256i lo = _mm256_and_si256(raw, nib), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
    const __m256i w0 = _mm256_unpacklo_epi8(lo, hi), w1 = _mm256_unpackhi_epi8(lo, hi);
    for (int j = 0; j < J; ++j) {
      const __m256i xb = _mm256_set1_epi32(xp[j][i]);
      acc[j][0] = _mm256_add_epi16(acc[j][0], _mm256_maddubs_epi16(w0, xb));
      acc[j][1] = _mm256_add_epi16(acc[j][1], _mm256_maddubs_epi16(w1, xb));
    }
  }
  for (int j = 0; j < J; ++j)
    for (int v = 0; v < 2; ++v) {
      out[j][2 * v] = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc[j][v]));
      out[j][2 * v + 1] = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc[j][v], 1));
    }
}

// y = x W^T + b over 4-bit records for M <= kDecodeRows rows, x in L int8 levels (see above).
template <class S, int L>
void records_decode(const GemvArgs& a, const uint8_t* packed, int64_t G) {
  const int64_t M = a.M, K = a.K, ng = K / G, tile_bytes = ng / S::GR * record_bytes<S>(G);
  const int64_t Kq = round_up(K, XB), nb = Kq / XB, streams = M * L;
  Scratch q_buf, pair_buf, dx_buf, sx_buf;
  int8_t* q = reinterpret_cast<int8_t*>(q_buf.get((streams * Kq + 3) / 4));
  int32_t* pairs = reinterpret_cast<int32_t*>(pair_buf.get(streams * Kq / 2));
  float* dx = dx_buf.get(streams * nb);
  float* sx = sx_buf.get(M * ng);
  const XCodes xc{q, dx};
  // x's levels, code pairs and group sums, split over the threads by blocks of 32 (serial, they cost ~10% at 2
  // threads on a 1B model's layers)
  parallel_for(nb, 16, a.num_threads, [&](int64_t b0, int64_t b1) {
    if constexpr (L == 1)
      code_blocks(a, Kq, xc, b0, b1);
    else
      split_x<L>(a, Kq, q, dx, b0, b1);
    for (int64_t st = 0; st < streams; ++st)
      for (int64_t i = b0 * XB / 2; i < b1 * XB / 2; ++i) {
        const uint32_t pr = uint8_t(q[st * Kq + 2 * i]) | uint32_t(uint8_t(q[st * Kq + 2 * i + 1])) << 8;
        pairs[st * Kq / 2 + i] = int32_t(pr | pr << 16);
      }
    group_sums(a, G, ng, sx, b0 * XB / G, imin(ng, b1 * XB / G));
  });
  parallel_for(a.tiles, 1, a.num_threads, [&](int64_t t0, int64_t t1) {
    alignas(64) float y[kDecodeRows * NT], d[NT], mn[NT];
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* rec = packed + t * tile_bytes;
      memset(y, 0, sizeof(float) * M * NT);
      for (int64_t g = 0; g < ng; ++g) {
        const int jg = int(g % S::GR);
        const uint8_t* r0 = rec + g / S::GR * record_bytes<S>(G);
        const uint8_t* p = r0 + jg * group_bytes<S>(G);
        const uint8_t* sc = r0 + S::GR * group_bytes<S>(G);
        if (jg == 0)
          for (int64_t l = 0; l < S::kBytes / 64; ++l) prefetch_l2(sc + l * 64 + 16384);
        for (int v = 0; v < NV; ++v) vstore(d + v * W, S::d(sc, jg, v)), vstore(mn + v * W, S::m(sc, jg, v));
        const int64_t xb = g * G / XB;
        for (int64_t j0 = 0; j0 < streams; j0 += 3) {  // L = 3: one row's levels at a time
          with_static_count<3>(int(imin(3, streams - j0)), [&](auto jc) {
            constexpr int J = decltype(jc)::value;
            static_assert(L == 1 || L == 3, "streams of several rows never share fsum");
            for (int h = 0; h < 2; ++h) {
              __m256 fsum[4];  // L > 1: the levels of one row, summed in float before y is touched
              for (int u = 0; u < 4; ++u) fsum[u] = _mm256_setzero_ps();
              for (int64_t r = 0; r < G / 2; r += kPairRowsPer16) {
                const int32_t* xs[J];
                for (int j = 0; j < J; ++j) xs[j] = pairs + (j0 + j) * Kq / 2 + (g * G) / 2 + r;
                __m256i isum[J][4];
                pair_dot<J>(p + r * NT, imin(kPairRowsPer16, G / 2 - r), h, xs, isum);
                for (int u = 0; u < 4; ++u) {
                  const int64_t c = 32 * h + 8 * (u / 2) + 16 * (u % 2);
                  for (int j = 0; j < J; ++j) {
                    const __m256 f = _mm256_cvtepi32_ps(isum[j][u]);
                    const __m256 s = _mm256_set1_ps(dx[(j0 + j) * nb + xb]);
                    if constexpr (L > 1) {
                      fsum[u] = _mm256_fmadd_ps(f, s, fsum[u]);
                    } else {
                      float* ya = y + (j0 + j) * NT + c;
                      _mm256_store_ps(ya, _mm256_fmadd_ps(f, _mm256_mul_ps(_mm256_load_ps(d + c), s), _mm256_load_ps(ya)));
                    }
                  }
                }
              }
              if constexpr (L > 1)
                for (int u = 0; u < 4; ++u) {
                  const int64_t c = 32 * h + 8 * (u / 2) + 16 * (u % 2);
                  float* ya = y + j0 / L * NT + c;
                  _mm256_store_ps(ya, _mm256_fmadd_ps(fsum[u], _mm256_load_ps(d + c), _mm256_load_ps(ya)));
                }
            }
          });
        }
        for (int64_t m = 0; m < M; ++m) {
          const __m256 sv = _mm256_set1_ps(sx[m * ng + g]);
          for (int64_t c = 0; c < NT; c += 8)
            _mm256_store_ps(y + m * NT + c, _mm256_fmadd_ps(_mm256_load_ps(mn + c), sv, _mm256_load_ps(y + m * NT + c)));
        }
      }
      store_tile(a, y, t);
    }
  });
}

#if defined(PAGEMILL_I8_ZMM)
// Q4_K and Q6_K for the int8 preset's M <= kDecodeRows rows: no panel. Each quad's codes are built in registers from
// two pair rows (and Q6_K's plane pairs), in the zmm panel order, and multiplied by every row's codes; each group's
// sums then take the panel path's integer arithmetic (add_scaled, super_finish), so a row's bits are those the panel
// path gives it. Zen 4, Q6_K, in cache, one core: 1.6x the float kernel's rate at one row, 2-2.3x at two and three
// (a 1B model's LM head and half its down_proj are Q6_K).

// A pair row's two k rows of codes: the low and high nibbles (Q6_K: with the high bits of k row 8 r + 2 t (+ 1) from
// the plane pairs moved to bits 4, 5).
struct PairCodes {
  __m512i even, odd;
};

inline PairCodes q4_codes(const uint8_t* p) {
  const __m512i raw = _mm512_loadu_si512(p), nib = _mm512_set1_epi8(0x0F);
  return {_mm512_and_si512(raw, nib), _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib)};
}

inline PairCodes q6_codes(const uint8_t* p, const PlanePairs& pb, int t) {
  const PairCodes c = q4_codes(p);
  const __m512i m30 = _mm512_set1_epi8(0x30);
  return {_mm512_ternarylogic_epi32(c.even, plane_pair_to<4>(pb.even, t), m30, 0xF8),  // lo | (pairs & m30)
          _mm512_ternarylogic_epi32(c.odd, plane_pair_to<4>(pb.odd, t), m30, 0xF8)};
}

// y = x W^T + b over Q4_K / Q6_K records for R rows of super-block codes xc (Kq per row).
template <class S, int R>
void super_decode_rows(const GemvArgs& a, const uint8_t* packed, const SuperCodes& xc, int64_t Kq) {
  constexpr int64_t G = Super<S>::G, planes = (S::B - 4) * (G / 8), ps = G / 8 * NT;
  const int64_t nsb = a.K / XS, tile_bytes = nsb * record_bytes<S>(G);
  const int16_t* sums = Super<S>::kMin ? xc.sum32 : xc.sum16;
  parallel_for(a.tiles, 1, a.num_threads, [&](int64_t t0, int64_t t1) {
    alignas(64) float y[R * NT], out[R * NT];
    alignas(64) SuperScales ss;
    for (int64_t t = t0; t < t1; ++t) {
      memset(y, 0, sizeof(y));
      for (int64_t sb = 0; sb < nsb; ++sb) {
        const uint8_t* rec = packed + t * tile_bytes + sb * record_bytes<S>(G);
        // each group's integer sums, scaled once the scale section that follows the groups is read: records are
        // read in order (reading the scales first cut 8B-sized layers streamed from DRAM from 34-39 to 28 GB/s)
        __m512i gsum[S::GR][R][4];
        for (int64_t g = 0; g < S::GR; ++g) {
          const uint8_t* p = rec + g * group_bytes<S>(G);
          const uint8_t* hp = p + G / 2 * NT;
          __m512i acc[R][4];
          for (int r = 0; r < R; ++r)
            for (int n = 0; n < 4; ++n) acc[r][n] = _mm512_setzero_si512();
          PlanePairs pb{};
          for (int64_t q = 0; q < G / 4; ++q) {  // quad q: pair rows 2 q, 2 q + 1 (k rows 4 q .. 4 q + 3)
            const int64_t i = 2 * q;
            prefetch_pair_row(p, hp, i, planes), prefetch_pair_row(p, hp, i + 1, planes);
            PairCodes ca, cb;
            if constexpr (S::B == 6) {
              if ((q & 1) == 0) pb = plane_pairs(hp + (q >> 1) * NT, ps);
              const int ta = int(i & 3);
              ca = q6_codes(p + i * NT, pb, ta), cb = q6_codes(p + (i + 1) * NT, pb, ta + 1);
            } else {
              ca = q4_codes(p + i * NT), cb = q4_codes(p + (i + 1) * NT);
            }
            const __m512i a0 = _mm512_unpacklo_epi8(ca.even, ca.odd), a1 = _mm512_unpackhi_epi8(ca.even, ca.odd);
            const __m512i b0 = _mm512_unpacklo_epi8(cb.even, cb.odd), b1 = _mm512_unpackhi_epi8(cb.even, cb.odd);
            const __m512i w[4] = {_mm512_unpacklo_epi16(a0, b0), _mm512_unpackhi_epi16(a0, b0),
                                  _mm512_unpacklo_epi16(a1, b1), _mm512_unpackhi_epi16(a1, b1)};
            for (int r = 0; r < R; ++r) {
              int32_t quad;
              memcpy(&quad, xc.q + r * Kq + sb * XS + g * G + 4 * q, 4);
              const __m512i xb = _mm512_set1_epi32(quad);
              for (int n = 0; n < 4; ++n) acc[r][n] = dpbusd(acc[r][n], w[n], xb);
            }
          }
          for (int r = 0; r < R; ++r)
            for (int n = 0; n < 4; ++n) gsum[g][r][n] = acc[r][n];
        }
        const uint8_t* scales = rec + S::GR * group_bytes<S>(G);
        prefetch_scales<S>(scales);
        super_scales<S>(scales, ss);
        __m512i isum[R][4];
        for (int r = 0; r < R; ++r)
          for (int n = 0; n < 4; ++n) isum[r][n] = _mm512_setzero_si512();
        for (int64_t g = 0; g < S::GR; ++g) add_scaled<R>(isum, gsum[g], ss, g);
        const int32_t* xp[R];
        float dx[R];
        for (int r = 0; r < R; ++r) {
          xp[r] = reinterpret_cast<const int32_t*>(sums + r * (Kq / G) + sb * XS / G);
          dx[r] = xc.dx[r * (Kq / XS) + sb];
        }
        super_finish<S, R>(isum, xp, dx, ss, y);
      }
      for (int r = 0; r < R; ++r) channel_order_zmm(y + r * NT, out + r * NT);
      store_tile(a, out, t);
    }
  });
}

// Q4_K / Q6_K at M <= kDecodeRows rows with int8 activations (the codes quantized as the panel path quantizes them).
template <class S>
void super_decode(const GemvArgs& a, const uint8_t* packed) {
  const int64_t Kq = round_up(a.K, XS);
  SuperCodeBuffers buffers;
  const SuperCodes xc = buffers.get(a, Kq);
  with_static_count<kDecodeRows>(int(a.M), [&](auto rc) {
    super_decode_rows<S, decltype(rc)::value>(a, packed, xc, Kq);
  });
}
#endif

// Channels c .. c + 3 and c + 16 .. c + 19 of a natural-order row: one panel-order vector.
inline __m256 panel_vector(const float* v, int64_t c) {
  return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(v + c)), _mm_loadu_ps(v + c + 16), 1);
}

// Quad vectors n = 2 hi + 0, 1 of half h (32 channels) from four int8 tile rows (k .. k + 3): gemv_i8's panel order.
inline void tile_quads(const int8_t* r, int h, int hi, __m256i& w0, __m256i& w1) {
  const __m256i* v = reinterpret_cast<const __m256i*>(r + 32 * h);
  const __m256i a = _mm256_loadu_si256(v), b = _mm256_loadu_si256(v + NT / 32);
  const __m256i c = _mm256_loadu_si256(v + NT / 16), d = _mm256_loadu_si256(v + 3 * NT / 32);
  const __m256i ab = hi ? _mm256_unpackhi_epi8(a, b) : _mm256_unpacklo_epi8(a, b);
  const __m256i cd = hi ? _mm256_unpackhi_epi8(c, d) : _mm256_unpacklo_epi8(c, d);
  w0 = _mm256_unpacklo_epi16(ab, cd), w1 = _mm256_unpackhi_epi16(ab, cd);
}

// y = x W^T + b over int8 tiles for the int8 preset's M <= kDecodeRows rows: quads built in registers (no panel),
// signed codes by the sign trick, one span (min(G, XB) k) at a time.
void int8_decode(const GemvArgs& a, const int8_t* q, const TileScales& sc, int64_t Kp, int64_t G) {
  const int64_t M = a.M, Kq = round_up(Kp, XB), nb = Kq / XB, ng = Kp / G, SP = imin(G, XB);
  Scratch q_buf, dx_buf, sx_buf;
  int8_t* xq = reinterpret_cast<int8_t*>(q_buf.get((M * Kq + 3) / 4));
  float* dx = dx_buf.get(M * nb);
  code_blocks(a, Kq, XCodes{xq, dx}, 0, nb);
  float* sx = nullptr;
  if (sc.has_min()) {
    sx = sx_buf.get(M * ng);
    group_sums(a, G, ng, sx);
  }
  parallel_for(a.tiles, 1, a.num_threads, [&](int64_t t0, int64_t t1) {
    alignas(64) float y[kDecodeRows * NT], out[kDecodeRows * NT];
    for (int64_t t = t0; t < t1; ++t) {
      const int8_t* tile = q + t * Kp * NT;
      memset(y, 0, sizeof(float) * M * NT);
      for (int64_t ks = 0; ks < Kp; ks += SP) {
        const int64_t g = ks / G;
        const float* d = sc.scales + (t * ng + g) * NT;
        const float* mn = sc.mins && ks % G == 0 ? sc.mins + (t * ng + g) * NT : nullptr;
        with_static_count<kDecodeRows>(int(M), [&](auto rc) {
          constexpr int R = decltype(rc)::value;
          for (int h = 0; h < 2; ++h)
            for (int hi = 0; hi < 2; ++hi) {
              __m256i acc[R][2];
              for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
              for (int64_t k = ks; k < ks + SP; k += 4) {
                const int8_t* rk = tile + k * NT;
                if (h == 0 && hi == 0)
                  for (int i = 0; i < 4; ++i) prefetch_l1(rk + i * NT + 2048), prefetch_l2(rk + i * NT + 16384);
                __m256i w0, w1;
                tile_quads(rk, h, hi, w0, w1);
                for (int r = 0; r < R; ++r) {
                  int32_t quad;
                  memcpy(&quad, xq + r * Kq + k, 4);
                  const __m256i xb = _mm256_set1_epi32(quad);
                  acc[r][0] = Dot<true>::add(acc[r][0], w0, xb);
                  acc[r][1] = Dot<true>::add(acc[r][1], w1, xb);
                }
              }
              for (int n2 = 0; n2 < 2; ++n2) {
                const int64_t c = 32 * h + 4 * (2 * hi + n2), pos = (h * 4 + 2 * hi + n2) * 8;
                const __m256 dv = panel_vector(d, c);
                for (int r = 0; r < R; ++r) {
                  float* ya = y + r * NT + pos;
                  __m256 yv = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Dot<true>::finish(acc[r][n2])),
                                              _mm256_mul_ps(dv, _mm256_set1_ps(dx[r * nb + ks / XB])), _mm256_load_ps(ya));
                  if (mn) yv = _mm256_fmadd_ps(panel_vector(mn, c), _mm256_set1_ps(sx[r * ng + g]), yv);
                  _mm256_store_ps(ya, yv);
                }
              }
            }
        });
      }
      for (int64_t m = 0; m < M; ++m) channel_order(y + m * NT, out + m * NT);
      store_tile(a, out, t);
    }
  });
}

template <class S>
bool records_decode_dispatch(const GemvArgs& a, const uint8_t* packed, int64_t G) {
  if (a.int8_activations) return records_decode<S, 1>(a, packed, G), true;
#if defined(__AVX512F__)
  return false;  // the float kernel (AVX-512 unpack) is faster at one row
#else
  if (a.M > 1) return false;  // measured: from 2 rows the float kernel's shared unpack wins
  return records_decode<S, 3>(a, packed, G), true;
#endif
}
#else
template <class S>
bool records_decode_dispatch(const GemvArgs&, const uint8_t*, int64_t) {
  return false;
}
#endif

}  // namespace

bool gemv_records_i8(const GemvArgs& a, const uint8_t* packed, RecordFormat format) {
  switch (format) {  // the 4-bit records everywhere, 6-bit with VNNI; 5-bit codes stay on the float kernels
    case RecordFormat::Q4_1: records_i8<DMScales<4>>(a, packed, 32); return true;
    case RecordFormat::Q4_K: records_i8<KScales<4, 8>>(a, packed, 32); return true;
    case RecordFormat::Q2_K: records_i8<KScales<4, 16>>(a, packed, 16); return true;
    case RecordFormat::Q3_K: records_i8<SubScales<4, 4>>(a, packed, 16); return true;
#if defined(PAGEMILL_I8_ZMM)
    // 6-bit codes need int32 sums (AVX2's 16-bit maddubs sums would overflow; AVX2 lays Q6_K out as int8 tiles, which
    // take int8 activations there too). Zen 5, 2048 x 8192, 16 rows 1.18 vs 1.82 ms float, 32 rows 2.50 vs 2.99
    // (before the super-blocks); 1-3 rows take super_decode (the same bits). 5-bit records stay on the float kernels: on Gemma 3 Q4_K_M their int8
    // products moved top-1 agreement from 0.963 to 0.943.
    case RecordFormat::Q6_K:
      records_i8<SubScales<6, 32>>(a, packed, 16);
      return true;
#endif
    default: return false;
  }
}

bool gemv_int8_i8(const GemvArgs& a, const int8_t* q, const float* scales, const float* mins, int64_t Kp, int64_t G) {
  if (G % 4 != 0 || KBI % G != 0) return false;
  const TileScales sc{scales, mins, Kp / G};
#if defined(__AVX2__)
  // measured (1B down_proj shape, Zen 3): 1.7x the panel kernel at one row, even at two, slower from three
  if (a.M <= 2 && !a.direct_only && (G % XB == 0 || XB % G == 0)) return int8_decode(a, q, sc, Kp, G), true;
#endif
  run_i8<true>(a, Kp, G, q, Kp * NT, [&](int64_t t, int64_t k0, int64_t k1, uint8_t* panel) {
    const int8_t* tile = q + t * Kp * NT;
    for (int64_t k = k0; k < k1; k += 4) quad_from_rows(tile + k * NT, panel + (k - k0) / 4 * 8 * PV);
  }, sc);
  return true;
}

bool gemv_records_decode(const GemvArgs& a, const uint8_t* packed, RecordFormat format) {
  if (a.M > kDecodeRows || a.direct_only) return false;
  switch (format) {
    case RecordFormat::Q4_1: return records_decode_dispatch<DMScales<4>>(a, packed, 32);
    case RecordFormat::Q4_K:
#if defined(PAGEMILL_I8_ZMM)
      if (a.int8_activations) return super_decode<KScales<4, 8>>(a, packed), true;
#endif
      return records_decode_dispatch<KScales<4, 8>>(a, packed, 32);
    case RecordFormat::Q2_K: return records_decode_dispatch<KScales<4, 16>>(a, packed, 16);
    case RecordFormat::Q3_K: return records_decode_dispatch<SubScales<4, 4>>(a, packed, 16);
#if defined(PAGEMILL_I8_ZMM)
    case RecordFormat::Q6_K:
      if (!a.int8_activations) return false;
      return super_decode<SubScales<6, 32>>(a, packed), true;
#endif
    default: return false;
  }
}

}  // namespace PAGEMILL_ISA
}  // namespace pagemill
