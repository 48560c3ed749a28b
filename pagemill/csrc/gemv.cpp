// Small-M linear layers (y = x W^T + b, M = 1..16 rows) for decode: the weights are streamed once from
// memory, so the kernels are "vertical" GEMVs over a packed layout that needs no horizontal reductions.
//
// Packed layout: W [N, K] -> [N/NT (rounded up), K, NT] with NT = 64 output channels per tile, so a tile is
// one contiguous stream and each k step is one row of NT weights, multiplied by the broadcast x[m][k] of
// each row m into register accumulators (fp32). Channels beyond N are zero padding.
//   fp16: packed [T, K, NT] float16.
//   int8: q [T, Kp, NT] int8 (K padded to a multiple of the group size G with zeros) and scales
//         [T, Kp / G, NT] float32, symmetric per (output channel, group of G along K): w = q * scale.
//   q4:   Q4_1 (4-bit codes, per-group fp16 scale and min), one record stream per tile: see its section below.
#include "ops.h"
#include "vec.h"
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t NT = 64;      // output channels per tile (4 zmm)
constexpr int NV = NT / 16;     // zmm vectors per row of a tile
constexpr int MR_MAX = 6;       // rows per register block: 6 x 4 accumulators + 4 weights + 1 broadcast
constexpr int64_t KB = 256;     // k block when x has several row blocks: one tile block (32 KiB fp16) stays in L1

// Software prefetch across 4 KiB pages, which the hardware streamers do not cross: per core, it gives ~20% more
// DRAM bandwidth at M = 1. Distances are in bytes ahead of row k; measured on the per-token weight set.
struct F16W {
  const at::Half* w;
  inline __m512 load(int64_t k, int v) const {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * NT + v * 16)));
  }
  inline void prefetch(int64_t k) const {  // a row is 2 lines; an L1 prefetch as well measured slower
    const char* p = reinterpret_cast<const char*>(w + k * NT) + 8192;
    _mm_prefetch(p, _MM_HINT_T1);
    _mm_prefetch(p + 64, _MM_HINT_T1);
  }
};

struct I8W {
  const int8_t* w;
  inline __m512 load(int64_t k, int v) const {
    __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * NT + v * 16));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
  }
  inline void prefetch(int64_t k) const {  // a row is 1 line
    const char* p = reinterpret_cast<const char*>(w + k * NT);
    _mm_prefetch(p + 2048, _MM_HINT_T0);
    _mm_prefetch(p + 16384, _MM_HINT_T1);
  }
};

// acc[m][:] (+)= scale * sum_{k0<=k<k1} x[m][k] * W[k][:] for MR rows of x (row stride ldx) and one tile.
// scale == nullptr means 1; first == true overwrites acc instead of adding.
template <int MR, class W>
inline void block(const W& w, const float* x, int64_t ldx, int64_t k0, int64_t k1, float* acc,
                  const float* scale, bool first) {
  __m512 c[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) c[m][v] = _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; ++k) {
    w.prefetch(k);
    __m512 b[NV];
    for (int v = 0; v < NV; ++v) b[v] = w.load(k, v);
    for (int m = 0; m < MR; ++m) {
      const __m512 xm = _mm512_set1_ps(x[m * ldx + k]);
      for (int v = 0; v < NV; ++v) c[m][v] = _mm512_fmadd_ps(b[v], xm, c[m][v]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    const __m512 s = scale ? _mm512_loadu_ps(scale + v * 16) : _mm512_set1_ps(1.0f);
    for (int m = 0; m < MR; ++m) {
      float* a = acc + m * NT + v * 16;
      const __m512 prev = first ? _mm512_setzero_ps() : _mm512_loadu_ps(a);
      _mm512_storeu_ps(a, _mm512_fmadd_ps(c[m][v], s, prev));
    }
  }
}

template <class W>
inline void block_rows(int mr, const W& w, const float* x, int64_t ldx, int64_t k0, int64_t k1, float* acc,
                       const float* scale, bool first) {
  pagemill::with_static_count<MR_MAX>(mr, [&](auto r) {
    block<decltype(r)::value>(w, x, ldx, k0, k1, acc, scale, first);
  });
}

// x as fp32 rows: a view of x if it already is, else a converted copy.
torch::Tensor as_f32(const torch::Tensor& x) {
  return x.scalar_type() == at::kFloat ? x : x.to(at::kFloat).contiguous();
}

void check_io(const torch::Tensor& out, const torch::Tensor& x, int64_t K, int64_t tiles, int64_t N,
              const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == K, "gemv: x must be contiguous [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf, "gemv: x must be float32 or float16");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == x.size(0), "gemv: out must be contiguous [M, N]");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kHalf,
              "gemv: out must be float32 or float16");
  TORCH_CHECK(N <= tiles * NT, "gemv: out has more columns than the packed weight");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "gemv: bias must be contiguous float32 [N]");
}

// Output rows [M, N], fp32 or fp16.
struct Out {
  float* f;
  at::Half* h;
  explicit Out(torch::Tensor& out)
      : f(out.scalar_type() == at::kFloat ? out.data_ptr<float>() : nullptr),
        h(out.scalar_type() == at::kHalf ? out.data_ptr<at::Half>() : nullptr) {}
};

// out[:, tile t's channels] = acc (M rows of NT fp32) + bias; padding channels are dropped.
void store_tile(const Out& out, const float* acc, int64_t M, int64_t N, const float* bias, int64_t t) {
  const int64_t n0 = t * NT;
  const int64_t nn = std::min(NT, N - n0);
  const __mmask64 live = nn == 64 ? ~__mmask64(0) : (__mmask64(1) << nn) - 1;
  for (int v = 0; v < NV; ++v) {
    const __mmask16 mask = static_cast<__mmask16>(live >> (v * 16));
    if (!mask) break;
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0 + v * 16) : _mm512_setzero_ps();
    for (int64_t m = 0; m < M; ++m) {
      const __m512 y = _mm512_add_ps(_mm512_loadu_ps(acc + m * NT + v * 16), b);
      const int64_t o = m * N + n0 + v * 16;
      if (out.h)
        _mm256_mask_storeu_epi16(out.h + o, mask, _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT));
      else
        _mm512_mask_storeu_ps(out.f + o, mask, y);
    }
  }
}

// Runs the tiles [t0, t1) of y = x W^T + b. `make(t)` gives tile t's weight stream; `scales(t, k)` the
// scales of the group holding k (nullptr for unscaled weights), constant over [k, next_group(k)).
template <class MakeW, class Scales, class NextGroup>
void run(torch::Tensor& out, const float* x, int64_t M, int64_t K, int64_t N, const float* bias, int64_t tiles,
         MakeW make, Scales scales, NextGroup next_group) {
  const Out o(out);
  const int64_t nblk = (M + MR_MAX - 1) / MR_MAX;
  const int64_t mr = (M + nblk - 1) / nblk;  // balanced row blocks: 8 rows = 4 + 4, not 6 + 2
  const int64_t kb = nblk == 1 ? K : KB;     // one row block reads each weight once anyway
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) float acc[16 * NT];
    for (int64_t t = t0; t < t1; ++t) {
      const auto w = make(t);
      for (int64_t k0 = 0; k0 < K;) {
        const int64_t k1 = std::min({k0 + kb, K, next_group(k0)});
        for (int64_t m0 = 0; m0 < M; m0 += mr)
          block_rows(static_cast<int>(std::min(mr, M - m0)), w, x + m0 * K, K, k0, k1, acc + m0 * NT,
                     scales(t, k0), k0 == 0);
        k0 = k1;
      }
      store_tile(o, acc, M, N, bias, t);
    }
  });
}

// [Np, Kp] -> [Np / NT, Kp, NT]
torch::Tensor to_tiles(const torch::Tensor& w) {
  return w.view({w.size(0) / NT, NT, w.size(1)}).transpose(1, 2).contiguous();
}

}  // namespace

torch::Tensor pack_gemv_weight_f16(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.is_floating_point(), "pack_gemv_weight_f16: w must be a float [N, K] matrix");
  const int64_t N = w.size(0), Np = (N + NT - 1) / NT * NT;
  auto wp = torch::constant_pad_nd(w.to(at::kHalf), {0, 0, 0, Np - N});
  return to_tiles(wp);
}

void gemv_f16(torch::Tensor out, torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NT && packed.scalar_type() == at::kHalf && packed.is_contiguous(),
              "gemv_f16: packed must come from pack_gemv_weight_f16");
  const int64_t K = packed.size(1), tiles = packed.size(0), M = x.size(0), N = out.size(1);
  check_io(out, x, K, tiles, N, bias);
  TORCH_CHECK(M <= 16, "gemv_f16: at most 16 rows");
  if (M == 0 || N == 0) return;
  const auto xf = as_f32(x);
  const at::Half* wp = packed.data_ptr<at::Half>();
  run(out, xf.data_ptr<float>(), M, K, N, bias ? bias->data_ptr<float>() : nullptr, tiles,
      [&](int64_t t) { return F16W{wp + t * K * NT}; },
      [](int64_t, int64_t) -> const float* { return nullptr; }, [&](int64_t) { return K; });
}

std::vector<torch::Tensor> pack_gemv_weight_int8(torch::Tensor w, int64_t group_size) {
  TORCH_CHECK(w.dim() == 2 && w.is_floating_point(), "pack_gemv_weight_int8: w must be a float [N, K] matrix");
  TORCH_CHECK(group_size > 0, "pack_gemv_weight_int8: group_size must be positive");
  const int64_t N = w.size(0), K = w.size(1), Np = (N + NT - 1) / NT * NT;
  const int64_t G = std::min(group_size, K), Kp = (K + G - 1) / G * G;
  auto wf = torch::constant_pad_nd(w.to(at::kFloat), {0, Kp - K, 0, Np - N});
  auto groups = wf.view({Np, Kp / G, G});
  auto scale = groups.abs().amax(-1, /*keepdim=*/true) / 127.0;
  auto q = (groups / torch::where(scale > 0, scale, torch::ones_like(scale))).round().clamp(-127, 127);
  return {to_tiles(q.to(at::kChar).view({Np, Kp})), to_tiles(scale.view({Np, Kp / G}))};
}

void gemv_int8(torch::Tensor out, torch::Tensor x, torch::Tensor packed_q, torch::Tensor scales,
               c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(packed_q.dim() == 3 && packed_q.size(2) == NT && packed_q.scalar_type() == at::kChar &&
                  packed_q.is_contiguous(),
              "gemv_int8: packed_q must come from pack_gemv_weight_int8");
  const int64_t tiles = packed_q.size(0), Kp = packed_q.size(1), M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == tiles && scales.size(2) == NT && scales.size(1) > 0 &&
                  Kp % scales.size(1) == 0 && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "gemv_int8: scales must come from pack_gemv_weight_int8");
  const int64_t ng = scales.size(1), G = Kp / ng;
  TORCH_CHECK(K <= Kp && Kp - K < G, "gemv_int8: x has ", K, " columns, the packed weight ", Kp, " (padded)");
  check_io(out, x, K, tiles, N, bias);
  TORCH_CHECK(M <= 16, "gemv_int8: at most 16 rows");
  if (M == 0 || N == 0) return;
  const auto xf = as_f32(x);
  const int8_t* qp = packed_q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  run(out, xf.data_ptr<float>(), M, K, N, bias ? bias->data_ptr<float>() : nullptr, tiles,
      [&](int64_t t) { return I8W{qp + t * Kp * NT}; },
      [&](int64_t t, int64_t k) { return sp + (t * ng + k / G) * NT; },
      [&](int64_t k) { return (k / G + 1) * G; });
}

// ---------------------------------------------------------------------------------------------------------------
// Q4_1 weights (GGUF's 4-bit format): per (output channel, group of G along K), w = d * q + m with q in 0..15 and
// fp16 d >= 0, m. The engine holds these weights dequantized to fp32; pack_gemv_weight_q4 recovers (q, d, m)
// from them, exactly when they really are Q4_1 (reported by the max error), so the kernel streams ~0.625 byte
// per weight (G = 32) instead of 2 (fp16) and still computes with the exact weights.
//
// Packed layout: uint8 [T, K / G, R] with R = G / 2 * NT + 4 * NT bytes: for each tile and group one contiguous
// record of
//   G / 2 pair rows of NT bytes: byte c of pair row i = q[2i][c] | q[2i + 1][c] << 4 (channel c of the tile),
//   d as NT fp16, then m as NT fp16.
// Padding channels are zeros (d = m = 0).
//
// Kernel: per group, the weights are unpacked as f = 1 + q / 16 (a float built by bit placement, no int -> float
// conversion), so sum_k x_k w_k = 16 d * sum_k x_k f_k + (m - 16 d) * sum_k x_k, where the per-row group sums
// of x are computed once per call.
namespace {

constexpr int MRQ_MAX = 4;        // rows per register block (4 x 4 accumulators + unpacking constants)
constexpr int64_t Q4_DM = 4 * NT;  // bytes of a record's d and m
constexpr int64_t Q4_MAX_GROUP = 256;

int64_t q4_record_bytes(int64_t G) { return G / 2 * NT + Q4_DM; }

// Fits one group w[0, G) as d * q + m with fp16 d >= 0 and m: writes q and returns max |d * q + m - w|.
// First the standard Q4_1 fit (m = min, d = (max - min) / 15), which recovers any GGUF-quantized group (its
// codes span 0..15). A group of at most 16 distinct values whose codes do not (q in [o, o + j], j < 15) is then
// searched over (j, o): d = (max - min) / j, m = min - o * d, keeping the best fit (a wrong (j, o) can miss by
// little more than rounding when fp16(m) happens to land close).
float q4_fit_group(const float* w, int64_t G, uint8_t* q, at::Half& d_out, at::Half& m_out) {
  float lo = w[0], hi = w[0];
  for (int64_t k = 1; k < G; ++k) {
    lo = std::min(lo, w[k]);
    hi = std::max(hi, w[k]);
  }
  const float amax = std::max(std::fabs(lo), std::fabs(hi));
  if (!(amax <= 32768.0f)) {  // d or m would overflow fp16 (or w is not finite): not representable
    std::fill(q, q + G, 0);
    d_out = m_out = at::Half(0.0f);
    return std::numeric_limits<float>::max();
  }
  uint8_t cand[Q4_MAX_GROUP];
  auto fit = [&](int j, int o, uint8_t* qo, at::Half& dh, at::Half& mh) {
    dh = at::Half((hi - lo) / static_cast<float>(j));
    const float d = dh;
    mh = at::Half(lo - static_cast<float>(o) * d);
    const float m = mh;
    float err = 0.0f;
    for (int64_t k = 0; k < G; ++k) {
      const int qk = d > 0.0f ? std::min(15, std::max(0, static_cast<int>(std::nearbyint((w[k] - m) / d)))) : 0;
      qo[k] = static_cast<uint8_t>(qk);
      err = std::max(err, std::fabs(d * static_cast<float>(qk) + m - w[k]));
    }
    return err;
  };
  float best = fit(15, 0, q, d_out, m_out);
  if (best <= amax * 0x1p-22f) return best;  // the roundings of d * q + m (here and in the dequantization)
  float sorted[Q4_MAX_GROUP];
  std::copy(w, w + G, sorted);
  std::sort(sorted, sorted + G);
  if (std::unique(sorted, sorted + G) - sorted > 16) return best;
  for (int j = 15; j >= 1; --j) {
    for (int o = j == 15 ? 1 : 0; o + j <= 15; ++o) {
      at::Half dh, mh;
      const float err = fit(j, o, cand, dh, mh);
      if (err < best) {
        best = err;
        std::copy(cand, cand + G, q);
        d_out = dh;
        m_out = mh;
        if (best == 0.0f) return best;
      }
    }
  }
  return best;
}

// Fits every group of w (fp32 [N, K], contiguous); writes the packed layout when `packed` is not null.
// Returns max |d * q + m - w| / max |w|.
double q4_fit(const torch::Tensor& w, int64_t G, uint8_t* packed) {
  const int64_t N = w.size(0), K = w.size(1), ng = K / G, R = q4_record_bytes(G);
  const float* wp = w.data_ptr<float>();
  std::vector<float> row_err(N, 0.0f), row_max(N, 0.0f);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    uint8_t q[Q4_MAX_GROUP];
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t c = n % NT;
      for (int64_t g = 0; g < ng; ++g) {
        const float* wg = wp + n * K + g * G;
        at::Half d, m;
        row_err[n] = std::max(row_err[n], q4_fit_group(wg, G, q, d, m));
        for (int64_t k = 0; k < G; ++k) row_max[n] = std::max(row_max[n], std::fabs(wg[k]));
        if (!packed) continue;
        uint8_t* rec = packed + ((n / NT) * ng + g) * R;
        for (int64_t i = 0; i < G / 2; ++i) rec[i * NT + c] = static_cast<uint8_t>(q[2 * i] | q[2 * i + 1] << 4);
        at::Half* dm = reinterpret_cast<at::Half*>(rec + G / 2 * NT);
        dm[c] = d;
        dm[NT + c] = m;
      }
    }
  });
  const float err = *std::max_element(row_err.begin(), row_err.end());
  const float wmax = *std::max_element(row_max.begin(), row_max.end());
  if (err == std::numeric_limits<float>::max()) return std::numeric_limits<double>::infinity();
  return wmax > 0.0f ? static_cast<double>(err) / wmax : 0.0;
}

torch::Tensor q4_check_weight(const torch::Tensor& w, int64_t G, const char* fn) {
  TORCH_CHECK(w.dim() == 2 && w.is_floating_point(), fn, ": w must be a float [N, K] matrix");
  TORCH_CHECK(G >= 2 && G % 2 == 0 && G <= Q4_MAX_GROUP, fn, ": group_size must be even, in [2, 256]");
  TORCH_CHECK(w.size(1) % G == 0, fn, ": K (", w.size(1), ") must be a multiple of group_size (", G, ")");
  return w.to(at::kFloat).contiguous();
}

#if defined(__AVX512VBMI__) && defined(__GFNI__)
// A pair row (NT bytes, two nibbles each) -> 2 x NV vectors of f = 1 + q / 16: a GF(2) affine map moves each
// byte's low (high) nibble to bits 3..6 and sets bit 7, then a byte permute, merge-masked into 0x3F000000,
// makes each dword [0, 0, that byte, 0x3F]: the float bits 0x3F800000 | q << 19. Single-source vpermb issues
// every cycle here, the two-table vpermt2b only every other: ~4.4 cycles per 64 weights (M = 1), L1-resident.
struct Q4Unpack {
  __m512i lo_mat, hi_mat, exponent, idx[NV];
  static constexpr __mmask64 kByte2 = 0x4444444444444444ULL;
  Q4Unpack() {
    uint64_t lo = 0, hi = 0;
    for (int i = 3; i <= 6; ++i) {  // output bit i <- input bit i - 3 (+ 4): row 7 - i of the matrix
      lo |= uint64_t(1) << (i - 3) << (8 * (7 - i));
      hi |= uint64_t(1) << (i + 1) << (8 * (7 - i));
    }
    lo_mat = _mm512_set1_epi64(static_cast<long long>(lo));
    hi_mat = _mm512_set1_epi64(static_cast<long long>(hi));
    exponent = _mm512_set1_epi32(0x3F000000);
    alignas(64) uint8_t ix[64] = {};
    for (int v = 0; v < NV; ++v) {
      for (int j = 0; j < 16; ++j) ix[4 * j + 2] = static_cast<uint8_t>(16 * v + j);
      idx[v] = _mm512_load_si512(ix);
    }
  }
  struct Row {
    __m512i even, odd;
  };
  inline Row row(const uint8_t* p) const {
    const __m512i raw = _mm512_loadu_si512(p);
    return {_mm512_gf2p8affine_epi64_epi8(raw, lo_mat, 0x80), _mm512_gf2p8affine_epi64_epi8(raw, hi_mat, 0x80)};
  }
  inline __m512 get(const __m512i& bytes, int v) const {
    return _mm512_castsi512_ps(_mm512_mask_permutexvar_epi8(exponent, kByte2, idx[v], bytes));
  }
  inline __m512 even(const Row& r, int v) const { return get(r.even, v); }
  inline __m512 odd(const Row& r, int v) const { return get(r.odd, v); }
};
#else
// Portable AVX-512F form: bytes -> dwords, nibble shifted to bits 19..22, exponent bits or'ed in.
struct Q4Unpack {
  struct Row {
    const uint8_t* p;
  };
  inline Row row(const uint8_t* p) const { return {p}; }
  static inline __m512i bytes(const Row& r, int v) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r.p + 16 * v)));
  }
  static inline __m512 place(__m512i shifted) {  // (shifted & 0x00780000) | 0x3F800000
    return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(shifted, _mm512_set1_epi32(0x00780000),
                                                         _mm512_set1_epi32(0x3F800000), 0xEA));
  }
  inline __m512 even(const Row& r, int v) const { return place(_mm512_slli_epi32(bytes(r, v), 19)); }
  inline __m512 odd(const Row& r, int v) const { return place(_mm512_slli_epi32(bytes(r, v), 15)); }
};
#endif

// acc[m][:] (+)= sum over groups [g0, g1) of one tile's records `rec` for MR rows of x (row stride ldx) and of
// their group sums sx (row stride ldsx); first == true overwrites acc.
template <int MR>
inline void block_q4(const Q4Unpack& u, const uint8_t* rec, int64_t R, int64_t G, int64_t g0, int64_t g1,
                     const float* x, int64_t ldx, const float* sx, int64_t ldsx, float* acc, bool first) {
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* p = rec + g * R;
    const float* xg = x + g * G;
    __m512 c[MR][NV];
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < NV; ++v) c[m][v] = _mm512_setzero_ps();
    for (int64_t i = 0; i < G / 2; ++i) {
      const uint8_t* pi = p + i * NT;
      _mm_prefetch(reinterpret_cast<const char*>(pi) + 2048, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(pi) + 16384, _MM_HINT_T1);
      const auto r = u.row(pi);
      for (int v = 0; v < NV; ++v) {
        const __m512 f = u.even(r, v);
        for (int m = 0; m < MR; ++m) c[m][v] = _mm512_fmadd_ps(f, _mm512_set1_ps(xg[m * ldx + 2 * i]), c[m][v]);
      }
      for (int v = 0; v < NV; ++v) {
        const __m512 f = u.odd(r, v);
        for (int m = 0; m < MR; ++m) c[m][v] = _mm512_fmadd_ps(f, _mm512_set1_ps(xg[m * ldx + 2 * i + 1]), c[m][v]);
      }
    }
    const uint8_t* pdm = p + G / 2 * NT;
    for (int l = 0; l < Q4_DM / 64; ++l) {  // the pair-row prefetches above skip the records' d/m lines
      _mm_prefetch(reinterpret_cast<const char*>(pdm) + l * 64 + 2048, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(pdm) + l * 64 + 16384, _MM_HINT_T1);
    }
    const auto* dm = reinterpret_cast<const __m256i*>(pdm);
    for (int v = 0; v < NV; ++v) {
      const __m512 d16 = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(dm + v)), _mm512_set1_ps(16.0f));
      const __m512 m16 = _mm512_sub_ps(_mm512_cvtph_ps(_mm256_loadu_si256(dm + NV + v)), d16);
      for (int m = 0; m < MR; ++m) {
        float* a = acc + m * NT + v * 16;
        __m512 y = first && g == g0 ? _mm512_setzero_ps() : _mm512_loadu_ps(a);
        y = _mm512_fmadd_ps(c[m][v], d16, y);
        _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(sx[m * ldsx + g]), m16, y));
      }
    }
  }
}

inline void block_q4_rows(int mr, const Q4Unpack& u, const uint8_t* rec, int64_t R, int64_t G, int64_t g0,
                          int64_t g1, const float* x, int64_t ldx, const float* sx, int64_t ldsx, float* acc,
                          bool first) {
  pagemill::with_static_count<MRQ_MAX>(mr, [&](auto r) {
    block_q4<decltype(r)::value>(u, rec, R, G, g0, g1, x, ldx, sx, ldsx, acc, first);
  });
}

}  // namespace

std::vector<torch::Tensor> pack_gemv_weight_q4(torch::Tensor w, int64_t group_size) {
  const auto wf = q4_check_weight(w, group_size, "pack_gemv_weight_q4");
  const int64_t N = wf.size(0), K = wf.size(1), G = group_size;
  auto packed = torch::zeros({(N + NT - 1) / NT, K / G, q4_record_bytes(G)}, torch::dtype(at::kByte));
  const double err = q4_fit(wf, G, packed.data_ptr<uint8_t>());
  return {packed, torch::scalar_tensor(err, torch::dtype(at::kDouble))};
}

double q4_max_error(torch::Tensor w, int64_t group_size) {
  return q4_fit(q4_check_weight(w, group_size, "q4_max_error"), group_size, nullptr);
}

void gemv_q4(torch::Tensor out, torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) > Q4_DM && (packed.size(2) - Q4_DM) % NT == 0,
              "gemv_q4: packed must come from pack_gemv_weight_q4");
  const int64_t tiles = packed.size(0), ng = packed.size(1), R = packed.size(2), G = (R - Q4_DM) / NT * 2;
  const int64_t M = x.size(0), K = ng * G, N = out.size(1);
  check_io(out, x, K, tiles, N, bias);
  TORCH_CHECK(M <= 16, "gemv_q4: at most 16 rows");
  if (M == 0 || N == 0) return;
  const auto xf = as_f32(x);
  const float* xp = xf.data_ptr<float>();
  std::vector<float> sx(M * ng);  // per-row group sums of x
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < ng; ++g) {
      float s = 0.0f;
      for (int64_t k = 0; k < G; ++k) s += xp[m * K + g * G + k];
      sx[m * ng + g] = s;
    }
  const Out o(out);
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const int64_t nblk = (M + MRQ_MAX - 1) / MRQ_MAX;
  const int64_t mr = (M + nblk - 1) / nblk;
  const int64_t gb = nblk == 1 ? ng : std::max<int64_t>(1, KB / G);  // k blocks of ~KB: the tile block stays in L1
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    const Q4Unpack u;
    alignas(64) float acc[16 * NT];
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* rec = pp + t * ng * R;
      for (int64_t g0 = 0; g0 < ng; g0 += gb) {
        const int64_t g1 = std::min(ng, g0 + gb);
        for (int64_t m0 = 0; m0 < M; m0 += mr)
          block_q4_rows(static_cast<int>(std::min(mr, M - m0)), u, rec, R, G, g0, g1, xp + m0 * K, K,
                        sx.data() + m0 * ng, ng, acc + m0 * NT, g0 == 0);
      }
      store_tile(o, acc, M, N, bp, t);
    }
  });
}
