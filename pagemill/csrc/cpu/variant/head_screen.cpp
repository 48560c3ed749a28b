// The LM head for greedy rows: int8 logits, then the exact float32 logit of every token that could be the row's
// maximum. Exact argmax at int8 speed (VNNI: ~4x the float32 FMA rate) for the large-vocabulary heads that dominate
// batched decode (Gemma 3: 262k x 640).
//
// 1. x [M, K] is quantized per row and group of 32 (symmetric int8, scale max|x| / 127), keeping per row the norm of
//    the quantization error e and of x.
// 2. int8 logits L~ = sum_g sw sx (q_w . q_x) (int32 dots per group). The weights are w~ = sw q_w, per channel and
//    group of 32 (packing.cpp: pack_head_screen), whose error has norm Dw_n = |w_n - w~_n| and Nw_n = |w~_n| for
//    channel n. By Cauchy-Schwarz, |L_n - L~_n| <= B_n = Dw_n |x| + Nw_n |e| (+ the float32 rounding of L~_n,
//    at most a multiple of Nw_n |x~|): B_n = Dw_n a + Nw_n b with a row's a and b.
// 3. Every L_m >= L~_m - B_m, so a token with L~_n + B_n below lower = max_m (L~_m - B_m) cannot be the maximum;
//    every other logit (a handful: per-channel norms, not the largest one, keep B small for most tokens) is
//    recomputed exactly from the float32 table. So the row's argmax is exactly float32's; the rest of the row keeps
//    L~ (approximate: callers use it only for argmax). Each tile keeps, per row, max (L~ - B) and max (L~ + B).
// 4. A row with a structured-output bitmask takes the max and the candidates over its allowed tokens only, so its
//    argmax is float32's over the allowed tokens (the exact head, the mask, then argmax); disallowed tokens keep L~.
//
// Weight layout: q [T, K / 4, 64, 4] int8 (tiles of 64 channels; four consecutive k per channel: the operand of
// vpdpbusd), scales [T, K / 32, 64] fp32, offsets [T, K / 32, 64] int32 = -128 * (sum of the group's codes): VNNI
// multiplies unsigned x + 128 by signed w, the offset removes the 128 * sum(w) this adds.
#include "simd.h"

namespace pagemill {
namespace PAGEMILL_ISA {
namespace {

constexpr int64_t NT = 64;  // channels per tile
constexpr int64_t QG = 32;  // quantization group along K
constexpr int64_t KQ = QG / 4;  // k quads per group

// Each row's bound terms (B_n = Dw_n a[r] + Nw_n b[r]) and, per row and tile, max (L~ - B) and max (L~ + B).
struct RowBounds {
  const float* a;
  const float* b;
  float* tile_lo;  // [M, tiles]
  float* tile_hi;
};

// B_n of channel n for a row with terms (ra, rb).
inline float channel_bound(const HeadScreenArgs& a, int64_t n, float ra, float rb) {
  const float* tb = a.bounds + (n / NT) * 2 * NT + n % NT;  // bounds [T, 2, NT]: Dw, then Nw
  return tb[0] * ra + tb[NT] * rb;
}

// Per-row quantization of x: codes (int8; +128 as uint8 for VNNI), group scales, and the bound's row terms.
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, uint8_t* xu, float* sx, float* err_norm,
                   float* x_norm, float* xq_norm) {
  const int64_t G = K / QG;
  for (int64_t r = 0; r < M; ++r) {
    double e2 = 0.0, x2 = 0.0, q2 = 0.0;
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = x + r * K + g * QG;
      float amax = 0.0f;
      for (int64_t i = 0; i < QG; ++i) amax = fmaxf(amax, fabsf(xg[i]));
      const float s = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      sx[r * G + g] = s;
      for (int64_t i = 0; i < QG; ++i) {
        const float v = xg[i];
        int q = int(lrintf(v * inv));
        q = q > 127 ? 127 : (q < -127 ? -127 : q);
        xq[r * K + g * QG + i] = int8_t(q);
        xu[r * K + g * QG + i] = uint8_t(q + 128);
        const double approx = double(s) * double(q);
        e2 += (double(v) - approx) * (double(v) - approx);
        x2 += double(v) * double(v);
        q2 += approx * approx;
      }
    }
    err_norm[r] = float(sqrt(e2)), x_norm[r] = float(sqrt(x2)), xq_norm[r] = float(sqrt(q2));
  }
}

#if defined(__AVX512F__)
// 3 rows x the tile's 4 vectors: 12 int32 and 12 float sums, the 4 weight vectors and a broadcast in the 32 zmm. One
// pass per tile reads its codes in order; two 32-channel passes (4 rows x 2 vectors) read every other pair of lines
// of each quad row and streamed the 1B head ~25% slower (Zen 4: 14 vs 11 ms at one row, 40 vs 31 ms at 32).
constexpr int MR = 3;  // rows per register block
constexpr int NVB = 4;  // 16-lane vectors per pass: the whole tile

// int32 dots of one group for R rows and NVB vectors: acc[r][v] += sum over the group's 32 k of x * w.
template <int R>
inline void group_dots(const int8_t* xq, const uint8_t* xu, int64_t K, const int8_t* wq, __m512i (&acc)[MR][NVB]) {
#if defined(__AVX512VNNI__)
  (void)xq;
  for (int64_t kq = 0; kq < KQ; ++kq) {
    __m512i w[NVB];
    for (int v = 0; v < NVB; ++v) w[v] = _mm512_loadu_si512(wq + kq * NT * 4 + v * 64);
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      memcpy(&quad, xu + r * K + kq * 4, 4);
      const __m512i xb = _mm512_set1_epi32(quad);
      for (int v = 0; v < NVB; ++v) acc[r][v] = dpbusd(acc[r][v], xb, w[v]);
    }
  }
#else
  // |x| (unsigned) times w with x's sign: pairs of products fit int16 (2 * 127 * 127 < 32768).
  (void)xu;
  const __m512i ones = _mm512_set1_epi16(1), zero = _mm512_setzero_si512();
  for (int64_t kq = 0; kq < KQ; ++kq) {
    __m512i w[NVB];
    for (int v = 0; v < NVB; ++v) w[v] = _mm512_loadu_si512(wq + kq * NT * 4 + v * 64);
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      memcpy(&quad, xq + r * K + kq * 4, 4);
      const __m512i xb = _mm512_set1_epi32(quad), ax = _mm512_abs_epi8(xb);
      const __mmask64 neg = _mm512_movepi8_mask(xb);
      for (int v = 0; v < NVB; ++v) {
        const __m512i ws = _mm512_mask_sub_epi8(w[v], neg, zero, w[v]);
        acc[r][v] = _mm512_add_epi32(acc[r][v], _mm512_madd_epi16(_mm512_maddubs_epi16(ax, ws), ones));
      }
    }
  }
#endif
}

// Logits of one tile (64 channels) for rows [r0, r0 + R): out rows of N; per row the tile's max (L~ - B) and max (L~ + B).
template <int R>
void tile_rows(const HeadScreenArgs& a, const int8_t* xq, const uint8_t* xu, const float* sx, int64_t t, int64_t r0,
               const RowBounds& rb) {
  const int64_t K = a.K, G = K / QG, n0 = t * NT;
  float best_lo[MR], best_hi[MR];
  for (int r = 0; r < R; ++r) best_lo[r] = best_hi[r] = -FLT_MAX;
  for (int64_t half = 0; half < NT / (16 * NVB); ++half) {
    const int64_t c0 = half * 16 * NVB;  // first channel of this pass within the tile
    __m512 facc[MR][NVB];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NVB; ++v) facc[r][v] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const int64_t o = (t * G + g) * NT + c0;
      __m512i acc[MR][NVB];
      for (int v = 0; v < NVB; ++v) {
#if defined(__AVX512VNNI__)
        const __m512i init = _mm512_loadu_si512(a.offsets + o + v * 16);
#else
        const __m512i init = _mm512_setzero_si512();
#endif
        for (int r = 0; r < R; ++r) acc[r][v] = init;
      }
      const int8_t* wq = a.q + ((t * (K / 4) + g * KQ) * NT + c0) * 4;
      group_dots<R>(xq + r0 * K + g * QG, xu + r0 * K + g * QG, K, wq, acc);
      for (int v = 0; v < NVB; ++v) {
        const __m512 sw = _mm512_loadu_ps(a.scales + o + v * 16);
        for (int r = 0; r < R; ++r)
          facc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][v]), _mm512_mul_ps(sw, _mm512_set1_ps(sx[(r0 + r) * G + g])),
                                       facc[r][v]);
      }
    }
    const float* dw = a.bounds + t * 2 * NT + c0;  // the channels' Dw, then their Nw
    for (int r = 0; r < R; ++r) {
      float* out = a.logits + (r0 + r) * a.N + n0 + c0;
      const __m512 ra = _mm512_set1_ps(rb.a[r0 + r]), rbv = _mm512_set1_ps(rb.b[r0 + r]);
      __m512 lo = _mm512_set1_ps(-FLT_MAX), hi = lo;
      for (int v = 0; v < NVB; ++v) {
        const int64_t n = a.N - (n0 + c0 + v * 16);
        if (n <= 0) break;
        const __mmask16 m = lanes(n);
        // Whole aligned vectors bypass the caches: the [M, N] logits (33.5 MB for Gemma at 32 rows) are written once
        // and read back only around each row's maximum, so reading their lines in first (a plain store's RFO)
        // would double the traffic.
        if (n >= 16 && (reinterpret_cast<uintptr_t>(out + v * 16) & 63) == 0)
          _mm512_stream_ps(out + v * 16, facc[r][v]);
        else
          _mm512_mask_storeu_ps(out + v * 16, m, facc[r][v]);
        const __m512 b = _mm512_fmadd_ps(_mm512_loadu_ps(dw + v * 16), ra,
                                         _mm512_mul_ps(_mm512_loadu_ps(dw + NT + v * 16), rbv));
        lo = _mm512_mask_max_ps(lo, m, lo, _mm512_sub_ps(facc[r][v], b));
        hi = _mm512_mask_max_ps(hi, m, hi, _mm512_add_ps(facc[r][v], b));
      }
      best_lo[r] = fmaxf(best_lo[r], _mm512_reduce_max_ps(lo));
      best_hi[r] = fmaxf(best_hi[r], _mm512_reduce_max_ps(hi));
    }
  }
  for (int r = 0; r < R; ++r) {
    rb.tile_lo[(r0 + r) * a.tiles + t] = best_lo[r];
    rb.tile_hi[(r0 + r) * a.tiles + t] = best_hi[r];
  }
}

#elif defined(__AVX2__)
constexpr int MR = 4;
constexpr int NVB = 2;  // 8-lane vectors per chunk: 4 rows x 2 vectors of int32 sums stay in the 16 ymm registers

template <int R>
void tile_rows(const HeadScreenArgs& a, const int8_t* xq, const uint8_t*, const float* sx, int64_t t, int64_t r0,
               const RowBounds& rb) {
  const int64_t K = a.K, G = K / QG, n0 = t * NT;
  const __m256i ones = _mm256_set1_epi16(1);
  // The float sums of the whole tile live in L1 (16 ymm cannot hold them beside the integer sums); each group runs
  // the tile's four 16-channel chunks in turn, so the codes are read in order (a chunk per line of a quad row).
  alignas(32) float facc[MR][NT] = {};
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t c0 = 0; c0 < NT; c0 += 8 * NVB) {
      const int64_t o = (t * G + g) * NT + c0;
      __m256i acc[MR][NVB];
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < NVB; ++v) acc[r][v] = _mm256_setzero_si256();
      const int8_t* wq = a.q + ((t * (K / 4) + g * KQ) * NT + c0) * 4;
      for (int64_t kq = 0; kq < KQ; ++kq) {
        __m256i w[NVB];
        for (int v = 0; v < NVB; ++v)
          w[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + kq * NT * 4 + v * 32));
        for (int r = 0; r < R; ++r) {
          int32_t quad;
          memcpy(&quad, xq + (r0 + r) * K + g * QG + kq * 4, 4);
          const __m256i xb = _mm256_set1_epi32(quad), ax = _mm256_abs_epi8(xb);
          for (int v = 0; v < NVB; ++v)
            acc[r][v] = _mm256_add_epi32(
                acc[r][v], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w[v], xb)), ones));
        }
      }
      for (int v = 0; v < NVB; ++v) {
        const __m256 sw = _mm256_loadu_ps(a.scales + o + v * 8);
        for (int r = 0; r < R; ++r) {
          float* f = facc[r] + c0 + v * 8;
          const __m256 scale = _mm256_mul_ps(sw, _mm256_set1_ps(sx[(r0 + r) * G + g]));
          _mm256_store_ps(f, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][v]), scale, _mm256_load_ps(f)));
        }
      }
    }
  }
  const float* dw = a.bounds + t * 2 * NT;  // the channels' Dw, then their Nw
  for (int r = 0; r < R; ++r) {
    float* out = a.logits + (r0 + r) * a.N + n0;
    const float ra = rb.a[r0 + r], rbr = rb.b[r0 + r];
    const __m256 rav = _mm256_set1_ps(ra), rbv = _mm256_set1_ps(rbr);
    __m256 lo = _mm256_set1_ps(-FLT_MAX), hi = lo;
    float best_lo = -FLT_MAX, best_hi = -FLT_MAX;
    for (int64_t c = 0; c < NT; c += 8) {
      const int64_t n = imin(8, a.N - (n0 + c));
      if (n <= 0) break;
      const __m256 f = _mm256_load_ps(facc[r] + c);
      if (n == 8) {
        _mm256_storeu_ps(out + c, f);
        const __m256 b =
            _mm256_fmadd_ps(_mm256_loadu_ps(dw + c), rav, _mm256_mul_ps(_mm256_loadu_ps(dw + NT + c), rbv));
        lo = _mm256_max_ps(lo, _mm256_sub_ps(f, b));
        hi = _mm256_max_ps(hi, _mm256_add_ps(f, b));
        continue;
      }
      for (int64_t j = 0; j < n; ++j) {  // the last tile's partial vector
        out[c + j] = facc[r][c + j];
        const float b = channel_bound(a, n0 + c + j, ra, rbr);
        best_lo = fmaxf(best_lo, facc[r][c + j] - b);
        best_hi = fmaxf(best_hi, facc[r][c + j] + b);
      }
    }
    float l8[8], h8[8];
    _mm256_storeu_ps(l8, lo);
    _mm256_storeu_ps(h8, hi);
    for (int j = 0; j < 8; ++j) best_lo = fmaxf(best_lo, l8[j]), best_hi = fmaxf(best_hi, h8[j]);
    rb.tile_lo[(r0 + r) * a.tiles + t] = best_lo;
    rb.tile_hi[(r0 + r) * a.tiles + t] = best_hi;
  }
}

#else
constexpr int MR = 4;

template <int R>
void tile_rows(const HeadScreenArgs& a, const int8_t* xq, const uint8_t*, const float* sx, int64_t t, int64_t r0,
               const RowBounds& rb) {
  const int64_t K = a.K, G = K / QG, n0 = t * NT, n = imin(NT, a.N - n0);
  for (int r = 0; r < R; ++r) {
    const int8_t* xr = xq + (r0 + r) * K;
    float best_lo = -FLT_MAX, best_hi = -FLT_MAX;
    for (int64_t c = 0; c < n; ++c) {
      float sum = 0.0f;
      for (int64_t g = 0; g < G; ++g) {
        int32_t dot = 0;
        for (int64_t kq = 0; kq < KQ; ++kq) {
          const int8_t* w4 = a.q + ((t * (K / 4) + g * KQ + kq) * NT + c) * 4;
          for (int i = 0; i < 4; ++i) dot += int32_t(w4[i]) * int32_t(xr[g * QG + kq * 4 + i]);
        }
        sum += float(dot) * (a.scales[(t * G + g) * NT + c] * sx[(r0 + r) * G + g]);
      }
      a.logits[(r0 + r) * a.N + n0 + c] = sum;
      const float b = channel_bound(a, n0 + c, rb.a[r0 + r], rb.b[r0 + r]);
      best_lo = fmaxf(best_lo, sum - b);
      best_hi = fmaxf(best_hi, sum + b);
    }
    rb.tile_lo[(r0 + r) * a.tiles + t] = best_lo;
    rb.tile_hi[(r0 + r) * a.tiles + t] = best_hi;
  }
}
#endif

void tile_all_rows(const HeadScreenArgs& a, const int8_t* xq, const uint8_t* xu, const float* sx, int64_t t,
                   const RowBounds& rb) {
  int64_t r0 = 0;
  for (; r0 + MR <= a.M; r0 += MR) tile_rows<MR>(a, xq, xu, sx, t, r0, rb);
  switch (a.M - r0) {
    case 3: tile_rows<3>(a, xq, xu, sx, t, r0, rb); break;
    case 2: tile_rows<2>(a, xq, xu, sx, t, r0, rb); break;
    case 1: tile_rows<1>(a, xq, xu, sx, t, r0, rb); break;
    default: break;
  }
}

// Finite, by the exponent bits (-ffast-math lets the compiler drop isfinite and NaN comparisons).
inline bool finite_bits(float f) { return (f32_bits(f) & 0x7F800000u) != 0x7F800000u; }

inline bool nan_bits(float f) { return (f32_bits(f) & 0x7FFFFFFFu) > 0x7F800000u; }

// Exact float32 dot of a table row and x.
inline float exact_dot(const float* w, const float* x, int64_t K) {
  vf acc = vzero();
  int64_t k = 0;
  for (; k + W <= K; k += W) acc = vfma(vload(w + k), vload(x + k), acc);
  float sum = vsum(acc);
  for (; k < K; ++k) sum += w[k] * x[k];
  return sum;
}

// exact_dot of up to 4 table rows `rows[0 .. n)` with x, side by side (independent FMA chains), into out.
inline void exact_dots(const float* table, const int64_t* rows, int64_t n, const float* x, int64_t K, float* out) {
  if (n < 4) {
    for (int64_t l = 0; l < n; ++l) out[l] = exact_dot(table + rows[l] * K, x, K);
    return;
  }
  const float *w0 = table + rows[0] * K, *w1 = table + rows[1] * K, *w2 = table + rows[2] * K, *w3 = table + rows[3] * K;
  vf a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
  int64_t k = 0;
  for (; k + W <= K; k += W) {
    const vf xv = vload(x + k);
    a0 = vfma(vload(w0 + k), xv, a0);
    a1 = vfma(vload(w1 + k), xv, a1);
    a2 = vfma(vload(w2 + k), xv, a2);
    a3 = vfma(vload(w3 + k), xv, a3);
  }
  float s0 = vsum(a0), s1 = vsum(a1), s2 = vsum(a2), s3 = vsum(a3);
  for (; k < K; ++k) s0 += w0[k] * x[k], s1 += w1[k] * x[k], s2 += w2[k] * x[k], s3 += w3[k] * x[k];
  out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

// A row's allowed tokens (structured output): bit n % 32 of word n / 32 set; tokens past the mask's words are
// disallowed (as apply_token_bitmask does). `words` == nullptr: every token allowed.
struct RowMask {
  const uint32_t* words;
  int64_t num_words;
  bool allowed(int64_t n) const {
    return !words || (n / 32 < num_words && ((words[n / 32] >> (n % 32)) & 1u));
  }
};

// max (L~_n - B_n) over row r's allowed tokens (-FLT_MAX when none is allowed): a lower bound on its largest allowed
// exact logit. A tile whose max (L~ - B) over all its tokens is not above the best so far is skipped unread.
float allowed_lower(const HeadScreenArgs& a, const float* row, const float* tile_lo, const RowMask& mask, float ra,
                    float rb) {
  float top = -FLT_MAX;
  for (int64_t t = 0; t < a.tiles; ++t) {
    if (!(tile_lo[t] > top)) continue;
    const int64_t n1 = imin(a.N, (t + 1) * NT);
    for (int64_t w = t * NT / 32; w * 32 < n1; ++w) {
      uint32_t bits = w < mask.num_words ? mask.words[w] : 0u;
      while (bits) {
        const int64_t n = w * 32 + __builtin_ctz(bits);
        bits &= bits - 1;
        if (n < n1) top = fmaxf(top, row[n] - channel_bound(a, n, ra, rb));
      }
    }
  }
  return top;
}

// Recomputes every (allowed) logit of row r whose L~ + B reaches the row's lower bound (max of L~ - B over its
// allowed tokens), and the row's argmax (the first maximum) from them; returns how many. A masked row's argmax is
// that of the float32 logits with every disallowed token at -inf: token 0 when no allowed logit is above -inf, as
// torch's max over such a row gives.
int64_t recheck_row(const HeadScreenArgs& a, int64_t r, const RowBounds& rb) {
  const float* tile_lo = rb.tile_lo + r * a.tiles;
  const float* tile_hi = rb.tile_hi + r * a.tiles;
  const float ra = rb.a[r], rbb = rb.b[r];
  float* row = a.logits + r * a.N;
  const float* x = a.x + r * a.K;
  const int64_t mask_row = a.bitmask && a.mask_rows ? a.mask_rows[r] : -1;
  const RowMask mask{mask_row >= 0 ? reinterpret_cast<const uint32_t*>(a.bitmask + mask_row * a.mask_words) : nullptr,
                     a.mask_words};
  float lower = -FLT_MAX;
  if (mask.words) {
    lower = allowed_lower(a, row, tile_lo, mask, ra, rbb);
  } else {
    for (int64_t t = 0; t < a.tiles; ++t) lower = fmaxf(lower, tile_lo[t]);
  }
  int64_t best = -1;
  float best_value = 0.0f;
  auto take = [&](int64_t n, float v) {
    row[n] = v;
    if (best < 0 || (!nan_bits(best_value) && (nan_bits(v) || v > best_value))) {
      best = n;  // torch's rule: a NaN is the maximum (the first one wins), else the first largest value
      best_value = v;
    }
  };
  int64_t count = 0;
  if (ra < 0.0f || !finite_bits(lower)) {  // a non-finite input: no bound holds, the whole row is exact
    Scratch row_buf;
    float* decoded = a.table ? nullptr : row_buf.get(a.K);
    for (int64_t n = 0; n < a.N; ++n) {
      if (mask.allowed(n)) {
        const float* w = a.table ? a.table + n * a.K : decoded;
        if (!a.table) a.table_rows(a.table_rows_src, &n, 1, decoded);
        take(n, exact_dot(w, x, a.K));
        ++count;
      }
    }
  } else {
    // The candidates, ascending (so the first maximum wins, as in a scan): counted, then listed into a Scratch
    // buffer (a std::vector's out-of-line template code would be a symbol every ISA variant's object defines).
    auto each_candidate = [&](auto&& f) {
      for (int64_t t = 0; t < a.tiles; ++t) {
        if (tile_hi[t] < lower) continue;
        const int64_t n1 = imin(a.N, (t + 1) * NT);
        for (int64_t n = t * NT; n < n1; ++n)
          if (row[n] + channel_bound(a, n, ra, rbb) >= lower && mask.allowed(n)) f(n);
      }
    };
    int64_t nc = 0;
    each_candidate([&](int64_t) { ++nc; });
    Scratch cand_buf;
    int64_t* cand = reinterpret_cast<int64_t*>(cand_buf.get(2 * imax(1, nc)));
    int64_t listed = 0;
    each_candidate([&](int64_t n) { cand[listed++] = n; });
    // The table rows sit anywhere in a large table: their reads overlap when several are in flight (a flat row has
    // thousands of candidates), so the next kLanes rows are prefetched while kLanes dots run side by side (each its
    // own FMA chain in exact_dot's order: the same values as one at a time).
    // A head without a float32 table has each group of rows decoded into a scratch first (the same values).
    constexpr int64_t kLanes = 4;
    auto prefetch_rows = [&](int64_t i0, int64_t i1) {
      if (!a.table) return;
      for (int64_t i = i0; i < imin(nc, i1); ++i)
        for (int64_t b = 0; b < a.K * int64_t(sizeof(float)); b += 64)
          prefetch_l2(reinterpret_cast<const char*>(a.table + cand[i] * a.K) + b);
    };
    Scratch rows_buf;
    float* decoded = a.table ? nullptr : rows_buf.get(kLanes * a.K);
    const int64_t lane_rows[kLanes] = {0, 1, 2, 3};
    prefetch_rows(0, kLanes);
    for (int64_t i = 0; i < nc; i += kLanes) {
      prefetch_rows(i + kLanes, i + 2 * kLanes);
      const int64_t lanes_here = imin(kLanes, nc - i);
      float v[kLanes];
      if (a.table) {
        exact_dots(a.table, cand + i, lanes_here, x, a.K, v);
      } else {
        a.table_rows(a.table_rows_src, cand + i, lanes_here, decoded);
        exact_dots(decoded, lane_rows, lanes_here, x, a.K, v);
      }
      for (int64_t l = 0; l < lanes_here; ++l) take(cand[i + l], v[l]);
    }
    count = nc;
  }
  if (mask.words && (best < 0 || f32_bits(best_value) == 0xFF800000u)) best = 0;  // every allowed logit is -inf
  if (a.argmax) a.argmax[r] = best;
  return count;
}

}  // namespace

int64_t head_screen(const HeadScreenArgs& a) {
  const int64_t M = a.M, K = a.K, G = K / QG;
  int8_t* xq = static_cast<int8_t*>(malloc(size_t(M * K)));
  uint8_t* xu = static_cast<uint8_t*>(malloc(size_t(M * K)));
  float* sx = static_cast<float*>(malloc(sizeof(float) * size_t(M * G + 5 * M + 2 * M * a.tiles)));
  float* err_norm = sx + M * G;
  float* x_norm = err_norm + M;
  float* xq_norm = x_norm + M;
  float* ra = xq_norm + M;
  float* rb = ra + M;
  const RowBounds bounds{ra, rb, rb + M, rb + M + M * a.tiles};
  quantize_rows(a.x, M, K, xq, xu, sx, err_norm, x_norm, xq_norm);
  for (int64_t r = 0; r < M; ++r) {
    // B_n = Dw_n |x| + Nw_n (|e| + the float32 rounding of L~: G + 3 roundings of terms summing to at most
    // Nw_n |x~|, doubled for safety), both terms raised by 2^-16 for the float32 arithmetic of B itself; a
    // non-finite x makes a < 0 (recheck_row then recomputes the row).
    const float rounding = 2.0f * float(G + 3) * 0x1p-24f * xq_norm[r];
    ra[r] = x_norm[r] * (1.0f + 0x1p-16f);
    rb[r] = (err_norm[r] + rounding) * (1.0f + 0x1p-16f);
    if (!finite_bits(x_norm[r]) || !finite_bits(ra[r]) || !finite_bits(rb[r])) ra[r] = -1.0f, rb[r] = 0.0f;
  }
  parallel_for(a.tiles, 1, a.num_threads, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) tile_all_rows(a, xq, xu, sx, t, bounds);
#if defined(__AVX512F__)
    _mm_sfence();  // the streamed logits, visible before the recheck reads them
#endif
  });
  int64_t counts[64] = {0};
  const int64_t chunks = imin(64, M);
  parallel_for(chunks, 1, a.num_threads, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      for (int64_t r = c * M / chunks; r < (c + 1) * M / chunks; ++r) counts[c] += recheck_row(a, r, bounds);
  });
  int64_t total = 0;
  for (int64_t c = 0; c < chunks; ++c) total += counts[c];
  free(xq);
  free(xu);
  free(sx);
  return total;
}

}  // namespace PAGEMILL_ISA
}  // namespace pagemill
