// Linear layers over packed weights (y = x W^T + b). Up to 16 rows (decode) the weights are streamed once from
// memory, so the kernels are "vertical" GEMVs over a packed layout that needs no horizontal reductions; more rows
// run an fp32 micro-kernel over panels dequantized once per k block (run_panel), unless the call asks for the
// direct path (direct_only: 16-row chunks of it, so a row's sums run in one order whatever M).
//
// Packed layout (the same for every ISA variant; packing.cpp writes it): W [N, K] -> tiles of NT = 64 output
// channels, [N/NT (rounded up), K, NT], so a tile is one contiguous stream and each k step is one row of NT weights,
// multiplied by the broadcast x[m][k] of each row m into register accumulators (fp32). Channels beyond N are zeros.
//   fp16: [T, K, NT] float16.
//   int8: q [T, Kp, NT] int8 and scales [T, Kp / G, NT] float32 (w = q * scale per channel and group of G), with
//         optional mins [T, Kp / G, NT] float32 (w = q * scale + min: the int8 form of GGUF's formats with mins,
//         which fused layers mixing record kinds use).
//   records: GGUF's 4/5/6-bit formats as bit-plane records, see below (q4: Q4_1 with any even group G).
#include "gemv_common.h"

namespace pagemill {
namespace PAGEMILL_ISA {
namespace {

// Rows per register block and vectors per pass: MR x NVB accumulators + the weights and broadcasts in registers.
constexpr int MR_MAX = W == 16 ? 6 : 3;
template <int MR>
constexpr int vectors_per_pass() {
  return W == 16 || MR == 1 ? NV : 4;
}
constexpr int64_t KB = 256;  // k block when x has several row blocks: one tile block stays in L1
// Up to this many rows the direct kernels stream the weights inside the dot products (their accumulators live on
// the stack, acc[16 * NT]); more rows go through fp32 panels (unpacked once). Measured for Q4: the direct kernel
// wins up to 16 rows on AVX-512 and AVX2.
constexpr int64_t kDirectMaxRows = 16;

// Software prefetch across 4 KiB pages, which the hardware streamers do not cross: per core, it gives ~20% more
// DRAM bandwidth at M = 1. Distances are in bytes ahead of row k; measured on the per-token weight set.
// 16-bit weights (fp16 or bf16), widened to fp32 on load (exact): a row is 2 lines.
template <class H>
struct HalfW {
  const H* w;
  inline vf load(int64_t k, int v) const { return vload(w + k * NT + v * W); }
  inline void prefetch(int64_t k) const {
    const char* p = reinterpret_cast<const char*>(w + k * NT) + 8192;
    prefetch_l2(p);
    prefetch_l2(p + 64);
  }
};

struct I8W {
  const int8_t* w;
  inline vf load(int64_t k, int v) const { return vload_i8(w + k * NT + v * W); }
  inline void prefetch(int64_t k) const {  // a row is 1 line
    const char* p = reinterpret_cast<const char*>(w + k * NT);
    prefetch_l1(p + 2048);
    prefetch_l2(p + 16384);
  }
};

// The per-group offsets of weights w = q * scale + min: acc += min * (sum of x over the group). `sx` points at the
// group's column of the per-row group sums (row stride ldsx); mins == nullptr: no offsets.
struct MinTerm {
  const float* mins;
  const float* sx;
  int64_t ldsx;
};

// acc[m][v0 W : (v0 + NVB) W] (+)= scale * sum_{k0<=k<k1} x[m][k] * W[k][...] (+ the min term, when [k0, k1) is
// one whole group) for MR rows of x (row stride ldx). scale == nullptr means 1; first == true overwrites acc.
template <int MR, int NVB, class Wt>
inline void block(const Wt& w, const float* x, int64_t ldx, int64_t k0, int64_t k1, float* acc, const float* scale,
                  const MinTerm& mt, bool first, int v0) {
  vf c[MR][NVB];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NVB; ++v) c[m][v] = vzero();
  for (int64_t k = k0; k < k1; ++k) {
    if (v0 == 0) w.prefetch(k);
    // The NVB weight vectors first, then one broadcast at a time: MR NVB + NVB + 1 registers (MR = 6, NVB = 4 on
    // AVX-512: 29 of 32; a broadcast per row held across the weights instead needs 31, and GCC spills accumulators).
    vf b[NVB];
    for (int v = 0; v < NVB; ++v) b[v] = w.load(k, v0 + v);
    for (int m = 0; m < MR; ++m) {
      const vf xm = vset(x[m * ldx + k]);
      for (int v = 0; v < NVB; ++v) c[m][v] = vfma(b[v], xm, c[m][v]);
    }
  }
  for (int v = 0; v < NVB; ++v) {
    const vf s = scale ? vload(scale + (v0 + v) * W) : vset(1.0f);
    const vf mn = mt.mins ? vload(mt.mins + (v0 + v) * W) : vzero();
    for (int m = 0; m < MR; ++m) {
      float* a = acc + m * NT + (v0 + v) * W;
      vf y = vfma(c[m][v], s, first ? vzero() : vload(a));
      if (mt.mins) y = vfma(vset(mt.sx[m * mt.ldsx]), mn, y);
      vstore(a, y);
    }
  }
}

template <class Wt>
inline void block_rows(int mr, const Wt& w, const float* x, int64_t ldx, int64_t k0, int64_t k1, float* acc,
                       const float* scale, const MinTerm& mt, bool first) {
  with_static_count<MR_MAX>(mr, [&](auto r) {
    constexpr int MR = decltype(r)::value, NVB = vectors_per_pass<MR>();
    for (int v0 = 0; v0 < NV; v0 += NVB) block<MR, NVB>(w, x, ldx, k0, k1, acc, scale, mt, first, v0);
  });
}

// Runs every tile of y = x W^T + b, kDirectMaxRows rows at a time (one chunk up to that many rows; more only when
// the caller asks for the direct path with a.direct_only). `make(t)` gives tile t's weight stream; `scales(t, k)`
// the scales of the group holding k (nullptr for unscaled weights), constant over [k, next_group(k)); `mins(t, k)`
// that group's MinTerm for row 0 (mins == nullptr: none; else every [k, next_group(k)) range must be a whole group).
template <class MakeW, class Scales, class NextGroup, class Mins>
void run(const GemvArgs& a, MakeW make, Scales scales, NextGroup next_group, Mins mins) {
  const int64_t K = a.K;
  parallel_for(a.tiles, 1, a.num_threads, [&](int64_t t0, int64_t t1) {
    alignas(64) float acc[kDirectMaxRows * NT];
    for (int64_t t = t0; t < t1; ++t) {
      const auto w = make(t);
      for (int64_t r0 = 0; r0 < a.M; r0 += kDirectMaxRows) {
        const GemvArgs c = row_chunk(a, r0, imin(kDirectMaxRows, a.M - r0));
        const int64_t M = c.M;
        const int64_t nblk = (M + MR_MAX - 1) / MR_MAX;
        const int64_t mr = (M + nblk - 1) / nblk;  // balanced row blocks: 8 rows = 4 + 4, not 6 + 2
        const int64_t kb = nblk == 1 ? K : KB;     // one row block reads each weight once anyway
        for (int64_t k0 = 0; k0 < K;) {
          const int64_t k1 = imin(imin(k0 + kb, K), next_group(k0));
          const MinTerm mt = mins(t, k0);
          for (int64_t m0 = 0; m0 < M; m0 += mr)
            block_rows(int(imin(mr, M - m0)), w, c.x + m0 * K, K, k0, k1, acc + m0 * NT, scales(t, k0),
                       MinTerm{mt.mins, mt.sx ? mt.sx + (r0 + m0) * mt.ldsx : nullptr, mt.ldsx}, k0 == 0);
          k0 = k1;
        }
        store_tile(c, acc, t);
      }
    }
  });
}

// Many rows: a k block of the tile is dequantized once into an fp32 panel (L1-resident), then every row block runs
// the fp32 micro-kernel over it, so unpacking costs once per weight instead of once per row block.
constexpr int64_t KP = 64;  // panel rows: 64 x NT fp32 = 16 KiB

struct F32W {
  const float* w;
  inline vf load(int64_t k, int v) const { return vload(w + k * NT + v * W); }
  inline void prefetch(int64_t) const {}
};

// `dequant(t, k0, k1, panel)` writes rows [k0, k1) of tile t as fp32 to panel[(k - k0) * NT + c]; k blocks are
// multiples of `step` (the weight's group length) rows long.
// The fp32 micro-kernel over one panel for rows [0, M) in row blocks of mr. Not inlined: inside run_panel the
// dequantizer's constants (QUnpack: 7 vectors) stay in registers, and GCC then spills accumulators.
// Row blocks as even as can be (32 rows = 6 + 6 + 5 + 5 + 5 + 5, not 6 x 5 + 2).
__attribute__((noinline)) void panel_rows(const float* panel, int64_t k0, int64_t k1, const float* x, int64_t M,
                                          int64_t K, float* acc) {
  const F32W w{panel - k0 * NT};
  const int64_t nblk = (M + MR_MAX - 1) / MR_MAX, base = M / nblk, extra = M % nblk;
  for (int64_t i = 0, m0 = 0; i < nblk; ++i) {
    const int64_t mr = base + (i < extra);
    block_rows(int(mr), w, x + m0 * K, K, k0, k1, acc + m0 * NT, nullptr, MinTerm{}, k0 == 0);
    m0 += mr;
  }
}

// `tile_bytes`: each tile's weights are that many bytes from `weights` on (tile t at weights + t tile_bytes), read
// in k order: the next k block is prefetched while the current one is computed (NextBlock; without it
// Gemma 3's 18 gate_up at 32 rows took 11.0 ms against 7.7 with the weights in cache).
// Work is shared evenly: each thread takes whole tiles, and the tiles left over (tiles % threads) are split by rows,
// a share of each per thread (whole tiles alone left one thread waiting a tile in 9 or 15: SmolLM2's o_proj / qkv).
// A row's sums do not depend on the rows beside it, so the split changes no result.
template <class Dequant>
void run_panel(const GemvArgs& a, int64_t step, const void* weights, int64_t tile_bytes, Dequant dequant) {
  const int64_t M = a.M, K = a.K, kp = round_up(KP, step);
  const int64_t threads = omp_in_parallel() ? 1 : imax(1, imin(a.num_threads, a.tiles * M));
  // Leftover tiles are split when each share keeps a whole row block: dequantizing such a tile once per thread still
  // ends sooner than one thread doing all its rows while the others wait.
  const int64_t whole = M >= MR_MAX * threads ? a.tiles - a.tiles % threads : a.tiles;
  const auto tile_rows = [&](Scratch& acc_buf, Scratch& panel_buf, int64_t t, int64_t r0, int64_t r1) {
    float* acc = acc_buf.get((r1 - r0) * NT);
    float* panel = panel_buf.get(kp * NT);
    for (int64_t k0 = 0; k0 < K; k0 += kp) {
      const int64_t k1 = imin(k0 + kp, K);
      NextBlock(weights, tile_bytes, K, a.tiles, t, k1, kp).all();
      dequant(t, k0, k1, panel);
      panel_rows(panel, k0, k1, a.x + r0 * K, r1 - r0, K, acc);
    }
    store_tile(row_chunk(a, r0, r1 - r0), acc, t);
  };
  parallel_for(threads, 1, int(threads), [&](int64_t i0, int64_t i1) {
    Scratch acc_buf, panel_buf;
    for (int64_t i = i0; i < i1; ++i) {
      for (int64_t t = whole * i / threads; t < whole * (i + 1) / threads; ++t) tile_rows(acc_buf, panel_buf, t, 0, M);
      for (int64_t t = whole; t < a.tiles; ++t) {
        const int64_t r0 = M * i / threads, r1 = M * (i + 1) / threads;
        if (r0 < r1) tile_rows(acc_buf, panel_buf, t, r0, r1);
      }
    }
  });
}

// ----------------------------------------------------------------------------------------------------------------
// Bit-plane records: per (output channel, group of G along K), w = d * q + m with B-bit codes q (B = 4, 5, 6).
// Packed: uint8 [T, K / (GR G), R]: for each tile one contiguous record per GR groups, holding for each of its
// groups G / 2 pair rows of NT bytes (byte c of pair row i = low nibbles q[2i][c] | q[2i + 1][c] << 4), then B - 4
// high-bit planes of G / 8 rows of NT bytes (byte c of plane h, row r, bit j = bit 4 + h of q[8r + j][c]), and
// after the GR groups the record's scale section, which a scale source (DMScales, KScales, SubScales) turns into
// the d and m vectors of each group.
// The weights are unpacked as f = 1 + q / 2^B (a float built by bit placement, no int -> float conversion), so
// sum_k x_k w_k = 2^B d * sum_k x_k f_k + (m - 2^B d) * sum_k x_k, with the per-row group sums of x computed once.

constexpr int MRQ_MAX = W == 16 ? 4 : 2;

// Unpackers: row(p, hr, ps, j) reads pair row p (k rows 2i, 2i + 1) and, for B > 4, the plane rows hr + h ps holding
// their high bits at bits j, j + 1; even / odd(row, v) give vector v of f = 1 + q / 2^B for the two k rows.
#if defined(__AVX512VBMI__) && defined(__GFNI__)
// A GF(2) affine map moves each byte's low (high) nibble to bits 7 - B .. 10 - B and sets bit 7, the high planes'
// bits are or'ed in at bits 11 - B + h (masked byte adds), then a byte permute, merge-masked into 0x3F000000, makes
// each dword [0, 0, that byte, 0x3F]: the float bits 0x3F800000 | q << (23 - B). Single-source vpermb issues every
// cycle on the CPUs measured, the two-table vpermt2b only every other: ~4.4 cycles per 64 weights (M = 1, B = 4).
template <int B>
struct QUnpack {
  __m512i lo_mat, hi_mat, exponent, idx[NV];
  static constexpr __mmask64 kByte2 = 0x4444444444444444ULL;
  QUnpack() {
    uint64_t lo = 0, hi = 0;
    for (int b = 0; b < 4; ++b) {  // output bit o = 7 - B + b <- input bit b (+ 4): row 7 - o of the matrix
      const int o = 7 - B + b;
      lo |= uint64_t(1) << b << (8 * (7 - o));
      hi |= uint64_t(1) << (b + 4) << (8 * (7 - o));
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
  inline Row row(const uint8_t* p, const uint8_t* hr, int64_t ps, int j) const {
    const __m512i raw = _mm512_loadu_si512(p);
    __m512i e = _mm512_gf2p8affine_epi64_epi8(raw, lo_mat, 0x80), o = _mm512_gf2p8affine_epi64_epi8(raw, hi_mat, 0x80);
    for (int h = 0; h < B - 4; ++h) {
      const __m512i plane = _mm512_loadu_si512(hr + h * ps);
      const __m512i bit = _mm512_set1_epi8(static_cast<char>(1 << (11 - B + h)));
      // the bit is clear in e / o, so a masked byte add is the masked or AVX-512BW lacks
      e = _mm512_mask_add_epi8(e, _mm512_test_epi8_mask(plane, _mm512_set1_epi8(static_cast<char>(1 << j))), e, bit);
      o = _mm512_mask_add_epi8(o, _mm512_test_epi8_mask(plane, _mm512_set1_epi8(static_cast<char>(1 << (j + 1)))), o,
                               bit);
    }
    return {e, o};
  }
  inline vf get(const __m512i& bytes, int v) const {
    return _mm512_castsi512_ps(_mm512_mask_permutexvar_epi8(exponent, kByte2, idx[v], bytes));
  }
  inline vf even(const Row& r, int v) const { return get(r.even, v); }
  inline vf odd(const Row& r, int v) const { return get(r.odd, v); }
  // The same floats without vpermb, for cores that split 512-bit ops into two 256-bit halves (Zen 4), where a
  // byte permute beside each FMA costs ~0.3-0.5 cycle more than an unpack, shift or and: the bytes unpacked with 0x3F
  // are bfloat16 words, whose even / odd words become floats by a shift / a mask. The channels come out permuted:
  // f[0] / f[1] / f[2] / f[3] lane L dword i = channel 16 L + 2 i / 2 i + 1 / 8 + 2 i / 9 + 2 i (natural_order).
  inline void split(const __m512i& bytes, vf (&f)[NV]) const {
    const __m512i hi_byte = _mm512_set1_epi8(0x3F), high_word = _mm512_set1_epi32(int(0xFFFF0000u));
    const __m512i u0 = _mm512_unpacklo_epi8(bytes, hi_byte), u1 = _mm512_unpackhi_epi8(bytes, hi_byte);
    f[0] = _mm512_castsi512_ps(_mm512_slli_epi32(u0, 16)), f[1] = _mm512_castsi512_ps(_mm512_and_si512(u0, high_word));
    f[2] = _mm512_castsi512_ps(_mm512_slli_epi32(u1, 16)), f[3] = _mm512_castsi512_ps(_mm512_and_si512(u1, high_word));
  }
  // 6-bit codes (split form): row6 moves a pair of plane bits (plane_pairs) to bits 5, 6 (11 - B + h) with
  // plane_pair_to and merges it with one ternary op, where row's byte tests and masked adds take four ops per k row.
  inline Row row6(const uint8_t* p, const PlanePairs& pb, int t) const {
    const __m512i raw = _mm512_loadu_si512(p), m60 = _mm512_set1_epi8(0x60);
    const __m512i e = _mm512_gf2p8affine_epi64_epi8(raw, lo_mat, 0x80);
    const __m512i o = _mm512_gf2p8affine_epi64_epi8(raw, hi_mat, 0x80);
    return {_mm512_ternarylogic_epi32(e, plane_pair_to<5>(pb.even, t), m60, 0xF8),  // e | (pairs & m60)
            _mm512_ternarylogic_epi32(o, plane_pair_to<5>(pb.odd, t), m60, 0xF8)};
  }
  // split's channel order -> natural order (vector v lane j: channels 16 v + 4 j .. + 3).
  static inline void natural_order(vf (&f)[NV]) {
    const vf p0 = _mm512_unpacklo_ps(f[0], f[1]), p1 = _mm512_unpackhi_ps(f[0], f[1]);
    const vf p2 = _mm512_unpacklo_ps(f[2], f[3]), p3 = _mm512_unpackhi_ps(f[2], f[3]);
    const vf t0 = _mm512_shuffle_f32x4(p0, p1, 0x44), t1 = _mm512_shuffle_f32x4(p0, p1, 0xEE);
    const vf t2 = _mm512_shuffle_f32x4(p2, p3, 0x44), t3 = _mm512_shuffle_f32x4(p2, p3, 0xEE);
    f[0] = _mm512_shuffle_f32x4(t0, t2, 0x88), f[1] = _mm512_shuffle_f32x4(t0, t2, 0xDD);
    f[2] = _mm512_shuffle_f32x4(t1, t3, 0x88), f[3] = _mm512_shuffle_f32x4(t1, t3, 0xDD);
  }
};
#define PAGEMILL_SPLIT_UNPACK 1
#elif defined(__AVX512F__)
// AVX-512F form: bytes -> dwords, nibble shifted to bits 23 - B .. 26 - B, exponent bits or'ed in, then the high
// bits (64-channel byte-test masks of the plane rows) or'ed in at bits 27 - B + h.
template <int B>
struct QUnpack {
  struct Row {
    const uint8_t* p;
    __mmask64 even[B > 4 ? B - 4 : 1], odd[B > 4 ? B - 4 : 1];
  };
  inline Row row(const uint8_t* p, const uint8_t* hr, int64_t ps, int j) const {
    Row r{p, {}, {}};
    for (int h = 0; h < B - 4; ++h) {
      const __m512i plane = _mm512_loadu_si512(hr + h * ps);
      r.even[h] = _mm512_test_epi8_mask(plane, _mm512_set1_epi8(static_cast<char>(1 << j)));
      r.odd[h] = _mm512_test_epi8_mask(plane, _mm512_set1_epi8(static_cast<char>(1 << (j + 1))));
    }
    return r;
  }
  static inline __m512i bytes(const Row& r, int v) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r.p + W * v)));
  }
  static inline vf place(__m512i shifted, const __mmask64* high, int v) {
    __m512i f = _mm512_ternarylogic_epi32(shifted, _mm512_set1_epi32(0xF << (23 - B)), _mm512_set1_epi32(0x3F800000),
                                          0xEA);  // (shifted & nibble) | one
    for (int h = 0; h < B - 4; ++h)
      f = _mm512_mask_or_epi32(f, static_cast<__mmask16>(high[h] >> (16 * v)), f, _mm512_set1_epi32(1 << (27 - B + h)));
    return _mm512_castsi512_ps(f);
  }
  inline vf even(const Row& r, int v) const { return place(_mm512_slli_epi32(bytes(r, v), 23 - B), r.even, v); }
  inline vf odd(const Row& r, int v) const { return place(_mm512_slli_epi32(bytes(r, v), 19 - B), r.odd, v); }
};
#elif defined(__AVX2__)
// AVX2 form of the same bit placement, 8 channels per vector; a high bit j is shifted from its plane byte.
template <int B>
struct QUnpack {
  __m256i nibble = _mm256_set1_epi32(0xF << (23 - B)), one = _mm256_set1_epi32(0x3F800000);
  struct Row {
    const uint8_t* p;
    const uint8_t* hr;
    int64_t ps;
    int j;
  };
  inline Row row(const uint8_t* p, const uint8_t* hr, int64_t ps, int j) const { return {p, hr, ps, j}; }
  static inline __m256i bytes(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  inline vf place(__m256i shifted, const Row& r, int j, int v) const {
    __m256i f = _mm256_or_si256(_mm256_and_si256(shifted, nibble), one);
    for (int h = 0; h < B - 4; ++h) {
      const int to = 27 - B + h;
      const __m256i hb = _mm256_sll_epi32(bytes(r.hr + h * r.ps + W * v), _mm_cvtsi32_si128(to - j));
      f = _mm256_or_si256(f, _mm256_and_si256(hb, _mm256_set1_epi32(1 << to)));
    }
    return _mm256_castsi256_ps(f);
  }
  inline vf even(const Row& r, int v) const {
    return place(_mm256_slli_epi32(bytes(r.p + W * v), 23 - B), r, r.j, v);
  }
  inline vf odd(const Row& r, int v) const {
    return place(_mm256_slli_epi32(bytes(r.p + W * v), 19 - B), r, r.j + 1, v);
  }
};
#else
template <int B>
struct QUnpack {
  struct Row {
    const uint8_t* p;
    const uint8_t* hr;
    int64_t ps;
    int j;
  };
  inline Row row(const uint8_t* p, const uint8_t* hr, int64_t ps, int j) const { return {p, hr, ps, j}; }
  static inline vf unpack(const Row& r, int v, int shift, int j) {
    vf out;
    for (int i = 0; i < W; ++i) {
      int q = (r.p[W * v + i] >> shift) & 15;
      for (int h = 0; h < B - 4; ++h) q |= ((r.hr[h * r.ps + W * v + i] >> j) & 1) << (4 + h);
      out.v[i] = 1.0f + float(q) * (1.0f / float(1 << B));
    }
    return out;
  }
  inline vf even(const Row& r, int v) const { return unpack(r, v, 0, r.j); }
  inline vf odd(const Row& r, int v) const { return unpack(r, v, 4, r.j + 1); }
};
#endif

// Vector v of group j's scales, applied to a row's sums c = sum x f (f = 1 + q / 2^B) and group sum sx of x:
// sum x w = 2^B d c + (m - 2^B d) sx.
template <class S>
struct GroupScale {
  vf ds, ms;
  GroupScale(const uint8_t* sc, int j, int v)
      : ds(vmul(S::d(sc, j, v), vset(float(1 << S::B)))), ms(vsub(S::m(sc, j, v), ds)) {}
  // a[0 : W] (+)= the row's part of the output (zero: overwrite a)
  inline void add(const vf& c, float sx, float* a, bool zero) const {
    vstore(a, vfma(vset(sx), ms, vfma(c, ds, zero ? vzero() : vload(a))));
  }
};

// acc[m][...] (+)= sum over groups [g0, g1) of one tile's records `rec` for MR rows of x (row stride ldx) and their
// group sums sx (row stride ldsx), vectors [v0, v0 + NVB) of the tile; first == true overwrites acc.
template <class S, int MR, int NVB>
inline void block_q4(const QUnpack<S::B>& u, const uint8_t* rec, int64_t G, int64_t g0, int64_t g1, const float* x,
                     int64_t ldx, const float* sx, int64_t ldsx, float* acc, bool first, int v0) {
  const int64_t ps = G / 8 * NT, planes = (S::B - 4) * (G / 8);
  for (int64_t g = g0; g < g1; ++g) {
    const GroupRecords<S> gr(rec, G, g);
    const float* xg = x + g * G;
    vf c[MR][NVB];
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < NVB; ++v) c[m][v] = vzero();
    for (int64_t i = 0; i < G / 2; ++i) {
      if (v0 == 0) prefetch_pair_row(gr.p, gr.hp, i, planes);
      const auto r = u.row(gr.p + i * NT, gr.hp + (2 * i >> 3) * NT, ps, int(2 * i & 7));
      for (int v = 0; v < NVB; ++v) {
        const vf f = u.even(r, v0 + v);
        for (int m = 0; m < MR; ++m) c[m][v] = vfma(f, vset(xg[m * ldx + 2 * i]), c[m][v]);
      }
      for (int v = 0; v < NVB; ++v) {
        const vf f = u.odd(r, v0 + v);
        for (int m = 0; m < MR; ++m) c[m][v] = vfma(f, vset(xg[m * ldx + 2 * i + 1]), c[m][v]);
      }
    }
    if (v0 == 0 && gr.j == S::GR - 1) prefetch_scales<S>(gr.sc);
    for (int v = 0; v < NVB; ++v) {
      const GroupScale<S> gs(gr.sc, gr.j, v0 + v);
      for (int m = 0; m < MR; ++m) gs.add(c[m][v], sx[m * ldsx + g], acc + m * NT + (v0 + v) * W, first && g == g0);
    }
  }
}

#if defined(PAGEMILL_SPLIT_UNPACK)
// block_q4 for one row with QUnpack::split (cores with split 512-bit units).
template <class S>
inline void block_q4_split(const QUnpack<S::B>& u, const uint8_t* rec, int64_t G, int64_t g0, int64_t g1,
                           const float* x, const float* sx, float* acc, bool first) {
  const int64_t ps = G / 8 * NT, planes = (S::B - 4) * (G / 8);
  for (int64_t g = g0; g < g1; ++g) {
    const GroupRecords<S> gr(rec, G, g);
    const float* xg = x + g * G;
    vf c[NV];
    for (int v = 0; v < NV; ++v) c[v] = vzero();
    PlanePairs pb{};
    for (int64_t i = 0; i < G / 2; ++i) {
      prefetch_pair_row(gr.p, gr.hp, i, planes);
      const uint8_t* pi = gr.p + i * NT;
      typename QUnpack<S::B>::Row r;
      if constexpr (S::B == 6) {  // the two planes' bits for k rows 2i, 2i + 1 from the plane row's pair bytes
        const int t = int(i & 3);
        if (t == 0) pb = plane_pairs(gr.hp + (i >> 2) * NT, ps);
        r = u.row6(pi, pb, t);
      } else {
        r = u.row(pi, gr.hp + (2 * i >> 3) * NT, ps, int(2 * i & 7));
      }
      vf f[NV];
      u.split(r.even, f);
      const vf xe = vset(xg[2 * i]), xo = vset(xg[2 * i + 1]);
      for (int v = 0; v < NV; ++v) c[v] = vfma(f[v], xe, c[v]);
      u.split(r.odd, f);
      for (int v = 0; v < NV; ++v) c[v] = vfma(f[v], xo, c[v]);
    }
    if (gr.j == S::GR - 1) prefetch_scales<S>(gr.sc);
    QUnpack<S::B>::natural_order(c);
    for (int v = 0; v < NV; ++v) GroupScale<S>(gr.sc, gr.j, v).add(c[v], sx[g], acc + v * W, first && g == g0);
  }
}
#endif

template <class S>
inline void block_q4_rows(int mr, const QUnpack<S::B>& u, const uint8_t* rec, int64_t G, int64_t g0, int64_t g1,
                          const float* x, int64_t ldx, const float* sx, int64_t ldsx, float* acc, bool first) {
#if defined(PAGEMILL_SPLIT_UNPACK)
  if (mr == 1 && split_zmm_units()) return block_q4_split<S>(u, rec, G, g0, g1, x, sx, acc, first);
#endif
  with_static_count<MRQ_MAX>(mr, [&](auto r) {
    constexpr int MR = decltype(r)::value, NVB = vectors_per_pass<MR>();
    for (int v0 = 0; v0 < NV; v0 += NVB)
      block_q4<S, MR, NVB>(u, rec, G, g0, g1, x, ldx, sx, ldsx, acc, first, v0);
  });
}

// Rows [k0, k1) (whole groups) of tile t's records as fp32 weights d * q + m.
template <class S>
void dequant_q4(const QUnpack<S::B>& u, const uint8_t* rec, int64_t G, int64_t k0, int64_t k1, float* panel) {
  const int64_t R = record_bytes<S>(G), ps = G / 8 * NT;
  const vf scale = vset(float(1 << S::B)), one = vset(1.0f);
  for (int64_t g = k0 / G; g < k1 / G; ++g) {
    const int j = int(g % S::GR);
    const uint8_t* r0 = rec + g / S::GR * R;
    const uint8_t* p = r0 + j * group_bytes<S>(G);
    const uint8_t* sc = r0 + S::GR * group_bytes<S>(G);
    float* out = panel + (g * G - k0) * NT;
    vf dv[NV], mv[NV];
    for (int v = 0; v < NV; ++v) dv[v] = S::d(sc, j, v), mv[v] = S::m(sc, j, v);
    for (int64_t i = 0; i < G / 2; ++i) {
      const auto r = u.row(p + i * NT, p + G / 2 * NT + (2 * i >> 3) * NT, ps, int(2 * i & 7));
      for (int v = 0; v < NV; ++v) {
        vstore(out + 2 * i * NT + v * W, vfma(vmul(vsub(u.even(r, v), one), scale), dv[v], mv[v]));
        vstore(out + (2 * i + 1) * NT + v * W, vfma(vmul(vsub(u.odd(r, v), one), scale), dv[v], mv[v]));
      }
    }
  }
}

// y = x W^T + b over bit-plane records with scale source S (K / G groups of G).
template <class S>
void gemv_nibbles(const GemvArgs& a, const uint8_t* packed, int64_t G) {
  const int64_t M = a.M, K = a.K, ng = K / G, tile_bytes = ng / S::GR * record_bytes<S>(G);
  if (M > kDirectMaxRows && !a.direct_only) {
    const QUnpack<S::B> u;
    run_panel(a, G, packed, tile_bytes, [&](int64_t t, int64_t k0, int64_t k1, float* panel) {
      dequant_q4<S>(u, packed + t * tile_bytes, G, k0, k1, panel);
    });
    return;
  }
  Scratch sx_buf;
  float* sx = sx_buf.get(M * ng);
  group_sums(a, G, ng, sx);
  parallel_for(a.tiles, 1, a.num_threads, [&](int64_t t0, int64_t t1) {
    const QUnpack<S::B> u;
    alignas(64) float acc[kDirectMaxRows * NT];
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* rec = packed + t * tile_bytes;
      for (int64_t r0 = 0; r0 < M; r0 += kDirectMaxRows) {  // (one chunk unless a.direct_only)
        const GemvArgs c = row_chunk(a, r0, imin(kDirectMaxRows, M - r0));
        const int64_t nblk = (c.M + MRQ_MAX - 1) / MRQ_MAX;
        const int64_t mr = (c.M + nblk - 1) / nblk;
        const int64_t gb = nblk == 1 ? ng : imax(1, KB / G);  // k blocks of ~KB: the tile block stays in L1
        for (int64_t g0 = 0; g0 < ng; g0 += gb) {
          const int64_t g1 = imin(ng, g0 + gb);
          for (int64_t m0 = 0; m0 < c.M; m0 += mr)
            block_q4_rows<S>(int(imin(mr, c.M - m0)), u, rec, G, g0, g1, c.x + m0 * K, K, sx + (r0 + m0) * ng, ng,
                             acc + m0 * NT, g0 == 0);
        }
        store_tile(c, acc, t);
      }
    }
  });
}

// fp32 weights streamed from memory (gemv_f32): a row is 4 lines.
struct F32Stream {
  const float* w;
  inline vf load(int64_t k, int v) const { return vload(w + k * NT + v * W); }
  inline void prefetch(int64_t k) const {
    const char* p = reinterpret_cast<const char*>(w + k * NT) + 16384;
    for (int l = 0; l < 4; ++l) prefetch_l2(p + 64 * l);
  }
};

}  // namespace

void gemv_f32(const GemvArgs& a, const float* packed) {
  // The direct path for every M with k blocks at fixed offsets (multiples of KB): each output is the same sequence
  // of FMAs and block additions whatever M and the row's place among the rows (the batch-invariant dense matmul).
  const int64_t K = a.K;
  run(a, [&](int64_t t) { return F32Stream{packed + t * K * NT}; },
      [](int64_t, int64_t) -> const float* { return nullptr; }, [](int64_t k) { return (k / KB + 1) * KB; },
      [](int64_t, int64_t) { return MinTerm{}; });
}

namespace {

// y = x W^T + b over 16-bit tiles [T, K, NT] of element type H. With direct_only the k blocks sit at fixed offsets
// (multiples of KB), so a row's sums run in one order whatever M (as gemv_f32's).
template <class H>
void gemv_half(const GemvArgs& a, const uint16_t* packed) {
  const H* wp = reinterpret_cast<const H*>(packed);
  const int64_t K = a.K;
  if (a.M > kDirectMaxRows && !a.direct_only) {
    run_panel(a, 1, wp, K * NT * int64_t(sizeof(H)), [&](int64_t t, int64_t k0, int64_t k1, float* panel) {
      const HalfW<H> w{wp + t * K * NT};
      for (int64_t k = k0; k < k1; ++k)
        for (int v = 0; v < NV; ++v) vstore(panel + (k - k0) * NT + v * W, w.load(k, v));
    });
    return;
  }
  const bool fixed = a.direct_only;
  run(a, [&](int64_t t) { return HalfW<H>{wp + t * K * NT}; },
      [](int64_t, int64_t) -> const float* { return nullptr; },
      [&](int64_t k) { return fixed ? (k / KB + 1) * KB : K; }, [](int64_t, int64_t) { return MinTerm{}; });
}

}  // namespace

void gemv_f16(const GemvArgs& a, const uint16_t* packed) { gemv_half<f16>(a, packed); }

void gemv_bf16(const GemvArgs& a, const uint16_t* packed) { gemv_half<bf16>(a, packed); }

void gemv_int8(const GemvArgs& a, const int8_t* q, const float* scales, const float* mins, int64_t Kp, int64_t G) {
  if (a.int8_activations && gemv_int8_i8(a, q, scales, mins, Kp, G)) return;
  const int64_t ng = Kp / G;
  if (a.M > kDirectMaxRows && !a.direct_only) {
    run_panel(a, G, q, Kp * NT, [&](int64_t t, int64_t k0, int64_t k1, float* panel) {
      const I8W w{q + t * Kp * NT};
      for (int64_t k = k0; k < k1; ++k) {
        const int64_t o = (t * ng + k / G) * NT;
        for (int v = 0; v < NV; ++v) {
          const vf wk = vmul(w.load(k, v), vload(scales + o + v * W));
          vstore(panel + (k - k0) * NT + v * W, mins ? vadd(wk, vload(mins + o + v * W)) : wk);
        }
      }
    });
    return;
  }
  Scratch sx_buf;
  float* sx = nullptr;
  if (mins) {
    sx = sx_buf.get(a.M * ng);
    group_sums(a, G, ng, sx);
  }
  run(a, [&](int64_t t) { return I8W{q + t * Kp * NT}; },
      [&](int64_t t, int64_t k) { return scales + (t * ng + k / G) * NT; }, [&](int64_t k) { return (k / G + 1) * G; },
      [&](int64_t t, int64_t k) {
        return mins ? MinTerm{mins + (t * ng + k / G) * NT, sx + k / G, ng} : MinTerm{};
      });
}

void gemv_q4(const GemvArgs& a, const uint8_t* packed, int64_t G) { gemv_nibbles<DMScales<4>>(a, packed, G); }

void gemv_records(const GemvArgs& a, const uint8_t* packed, RecordFormat format) {
  if (gemv_records_decode(a, packed, format)) return;
  if (a.int8_activations && gemv_records_i8(a, packed, format)) return;
  switch (format) {
    case RecordFormat::Q4_1: return gemv_nibbles<DMScales<4>>(a, packed, 32);
    case RecordFormat::Q5_1: return gemv_nibbles<DMScales<5>>(a, packed, 32);
    case RecordFormat::Q4_K: return gemv_nibbles<KScales<4, 8>>(a, packed, 32);
    case RecordFormat::Q5_K: return gemv_nibbles<KScales<5, 8>>(a, packed, 32);
    case RecordFormat::Q6_K: return gemv_nibbles<SubScales<6, 32>>(a, packed, 16);
    case RecordFormat::Q2_K: return gemv_nibbles<KScales<4, 16>>(a, packed, 16);
    case RecordFormat::Q3_K: return gemv_nibbles<SubScales<4, 4>>(a, packed, 16);
  }
}

}  // namespace PAGEMILL_ISA
}  // namespace pagemill
