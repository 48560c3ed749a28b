// What the GEMV kernels over packed tiles share (variant/gemv.cpp: float activations; variant/gemv_i8.cpp: int8
// activations): the tile width, the record formats' scale sources, and storing a tile's accumulators.
#pragma once
#include "simd.h"

namespace pagemill {
namespace PAGEMILL_ISA {
namespace {

constexpr int64_t NT = 64;  // output channels per tile
constexpr int NV = NT / W;  // vectors per row of a tile

// out[:, tile t's channels] = acc (M rows of NT fp32) + bias; padding channels are dropped. Row by row: a row's
// NT outputs are adjacent lines (column by column, every store of a many-row tile missed the cache).
inline void store_tile(const GemvArgs& a, const float* acc, int64_t t) {
  const int64_t n0 = t * NT, nn = imin(NT, a.N - n0);
  vf b[NV];
  for (int v = 0; v < NV; ++v) b[v] = a.bias && v * W < nn ? vloadn(a.bias + n0 + v * W, nn - v * W) : vzero();
  const bool f16_out = a.out_dtype == DType::F16;
  for (int64_t m = 0; m < a.M; ++m) {
    const int64_t o = m * a.N + n0;
    for (int v = 0; v < NV && v * W < nn; ++v) {
      const vf y = vadd(vload(acc + m * NT + v * W), b[v]);
      if (f16_out)
        vstoren(static_cast<f16*>(a.out) + o + v * W, y, nn - v * W);
      else
        vstoren(static_cast<float*>(a.out) + o + v * W, y, nn - v * W);
    }
  }
}

// The weights of the k block [k1, k1 + kb) of tile t (the next tile's first block when k1 = K), to be prefetched
// into L2 while the current block is computed: tile t's weights are tile_bytes from base + t tile_bytes, laid out
// in k order (the block's bytes are taken as its share of the tile). The blocks' records otherwise come from DRAM a
// few misses at a time (the hardware streamers stop at every 4 KiB page). `slice(i, n)` prefetches the i-th of n
// slices, so that a block computed in steps spreads its prefetches over them (a burst of all at once stalls the core
// on its miss buffers).
struct NextBlock {
  const char* p = nullptr;
  int64_t b0 = 0, b1 = 0;
  NextBlock(const void* base, int64_t tile_bytes, int64_t K, int64_t tiles, int64_t t, int64_t k1, int64_t kb) {
    const int64_t nk0 = k1 < K ? k1 : 0, nt = k1 < K ? t : t + 1;
    if (base == nullptr || nt >= tiles) return;
    p = static_cast<const char*>(base) + nt * tile_bytes;
    b0 = nk0 * tile_bytes / K / 64 * 64;
    b1 = imin(tile_bytes, (imin(K, nk0 + kb) * tile_bytes + K - 1) / K);
  }
  inline void slice(int64_t i, int64_t n) const {
    if (p == nullptr) return;
    const int64_t lines = (b1 - b0 + 63) / 64, l0 = lines * i / n, l1 = lines * (i + 1) / n;
    for (int64_t l = l0; l < l1; ++l) prefetch_l2(p + b0 + 64 * l);
  }
  inline void all() const { slice(0, 1); }
};

// Rows [r0, r0 + n) of a call: x, out and M narrowed to them.
inline GemvArgs row_chunk(const GemvArgs& a, int64_t r0, int64_t n) {
  GemvArgs c = a;
  c.M = n;
  c.x = a.x + r0 * a.K;
  c.out = static_cast<char*>(a.out) + r0 * a.N * (a.out_dtype == DType::F16 ? 2 : 4);
  return c;
}

// One group per record; scale section d [NT] fp16, then m [NT] fp16: Q4_1, Q5_1, and Q4_0 / Q5_0 (m = -8 d / -16 d).
template <int Bits>
struct DMScales {
  static constexpr int B = Bits, GR = 1;
  static constexpr int64_t kBytes = 4 * NT;
  static inline vf d(const uint8_t* s, int, int v) { return vload(reinterpret_cast<const f16*>(s) + v * W); }
  static inline vf m(const uint8_t* s, int, int v) { return vload(reinterpret_cast<const f16*>(s) + NT + v * W); }
};

// Q4_K / Q5_K (8 groups of 32) and Q2_K (16 groups of 16, 2-bit codes in 4-bit records): a super-block per record;
// scale section D [NT] fp16, Dmin [NT] fp16, sc [GR][NT] uint8, mn [GR][NT] uint8 (6 / 4-bit): d = D sc and
// m = -(Dmin mn), products exact in fp32 (11 x 6 significant bits).
template <int Bits, int Groups>
struct KScales {
  static constexpr int B = Bits, GR = Groups;
  static constexpr int64_t kBytes = 4 * NT + 2 * GR * NT;
  static inline vf d(const uint8_t* s, int j, int v) {
    return vmul(vload(reinterpret_cast<const f16*>(s) + v * W), vload_u8(s + 4 * NT + j * NT + v * W));
  }
  static inline vf m(const uint8_t* s, int j, int v) {
    const vf dm = vmul(vload(reinterpret_cast<const f16*>(s) + NT + v * W), vload_u8(s + (4 + GR + j) * NT + v * W));
    return vsub(vzero(), dm);
  }
};

// Q6_K and Q3_K (3-bit codes in 4-bit records): a super-block of 16 groups of 16 per record; scale section D [NT]
// fp16, sc [16][NT] int8: d = D sc (exact), m = -Offset d (codes 0..2^B - 1 stand for q - Offset: 32, 4).
template <int Bits, int Offset>
struct SubScales {
  static constexpr int B = Bits, GR = 16;
  static constexpr int64_t kBytes = 2 * NT + GR * NT;
  static inline vf d(const uint8_t* s, int j, int v) {
    return vmul(vload(reinterpret_cast<const f16*>(s) + v * W),
                vload_i8(reinterpret_cast<const int8_t*>(s) + 2 * NT + j * NT + v * W));
  }
  static inline vf m(const uint8_t* s, int j, int v) { return vmul(d(s, j, v), vset(-float(Offset))); }
};

template <class S>
constexpr int64_t group_bytes(int64_t G) {
  return G / 2 * NT + (S::B - 4) * (G / 8) * NT;
}
template <class S>
constexpr int64_t record_bytes(int64_t G) {
  return S::GR * group_bytes<S>(G) + S::kBytes;
}

// Group g of a tile's records: its index j within the record, pair rows p, plane rows hp and scale section sc.
template <class S>
struct GroupRecords {
  int j;
  const uint8_t *p, *hp, *sc;
  GroupRecords(const uint8_t* rec, int64_t G, int64_t g) : j(int(g % S::GR)) {
    const uint8_t* r0 = rec + g / S::GR * record_bytes<S>(G);
    p = r0 + j * group_bytes<S>(G);
    hp = p + G / 2 * NT;
    sc = r0 + S::GR * group_bytes<S>(G);
  }
};

// Prefetches for pair row i of a group and, while i < planes, plane row i (the plane rows are not pair rows: their
// lines get prefetches of their own).
inline void prefetch_pair_row(const uint8_t* p, const uint8_t* hp, int64_t i, int64_t planes) {
  prefetch_l1(p + i * NT + 2048);
  prefetch_l2(p + i * NT + 16384);
  if (i < planes) {
    prefetch_l1(hp + i * NT + 2048);
    prefetch_l2(hp + i * NT + 16384);
  }
}

// Prefetches for a record's scale section (after its last group): nor are the scale lines pair rows.
template <class S>
inline void prefetch_scales(const uint8_t* sc) {
  for (int64_t l = 0; l < S::kBytes / 64; ++l) {
    prefetch_l1(sc + l * 64 + 2048);
    prefetch_l2(sc + l * 64 + 16384);
  }
}

#if defined(__AVX512BW__)
// 6-bit codes' high bits, plane row hr of plane 0 and hr + ps of plane 1 (k rows 8 r + j at bit j), paired: bits
// 2 t and 2 t + 1 of `even` / `odd` hold planes 0 and 1 of k row 8 r + 2 t / 8 r + 2 t + 1.
struct PlanePairs {
  __m512i even, odd;
};
inline PlanePairs plane_pairs(const uint8_t* hr, int64_t ps) {
  const __m512i p0 = _mm512_loadu_si512(hr), p1 = _mm512_loadu_si512(hr + ps), m55 = _mm512_set1_epi8(0x55);
  return {_mm512_ternarylogic_epi32(m55, p0, _mm512_slli_epi16(p1, 1), 0xCA),   // m55 ? p0 : p1 << 1
          _mm512_ternarylogic_epi32(m55, _mm512_srli_epi16(p0, 1), p1, 0xCA)};  // m55 ? p0 >> 1 : p1
}

// A plane pair's bits 2 t, 2 t + 1 moved to bits Lo, Lo + 1 of each byte (16-bit shifts: bits from a neighbouring
// byte are masked off by the caller).
template <int Lo>
inline __m512i plane_pair_to(const __m512i& v, int t) {
  const auto shift = [&](auto s) {
    constexpr int n = decltype(s)::value;
    if constexpr (n > 0) return _mm512_slli_epi16(v, n);
    else if constexpr (n < 0) return _mm512_srli_epi16(v, -n);
    else return v;
  };
  switch (t) {
    case 0: return shift(std::integral_constant<int, Lo>{});
    case 1: return shift(std::integral_constant<int, Lo - 2>{});
    case 2: return shift(std::integral_constant<int, Lo - 4>{});
    default: return shift(std::integral_constant<int, Lo - 6>{});
  }
}
#endif

// Per-row sums of x over groups of G (the last group may be short: x has K <= Kp columns).
// Groups [g0, g1) only where given (a thread's share).
inline void group_sums(const GemvArgs& a, int64_t G, int64_t ng, float* sx, int64_t g0 = 0, int64_t g1 = -1) {
  if (g1 < 0) g1 = ng;
  for (int64_t m = 0; m < a.M; ++m)
    for (int64_t g = g0; g < g1; ++g) {
      float s = 0.0f;
      for (int64_t k = g * G; k < imin(a.K, (g + 1) * G); ++k) s += a.x[m * a.K + k];
      sx[m * ng + g] = s;
    }
}

}  // namespace

// y = x W^T + b with x quantized to int8 per row and block of 32 (linear_dtype="int8"), over 4-bit records
// (records) or int8 tiles (int8); false when the format has no int8-activation kernel (the caller runs the float one).
bool gemv_records_i8(const GemvArgs& a, const uint8_t* packed, RecordFormat format);
// Decode-sized calls (<= 3 rows, not direct_only) over 4-bit records in integers: the int8 preset's rows, or on AVX2
// the exact path's x split into three int8 levels; false: the caller runs its other kernels.
bool gemv_records_decode(const GemvArgs& a, const uint8_t* packed, RecordFormat format);
bool gemv_int8_i8(const GemvArgs& a, const int8_t* q, const float* scales, const float* mins, int64_t Kp, int64_t G);

}  // namespace PAGEMILL_ISA
}  // namespace pagemill
