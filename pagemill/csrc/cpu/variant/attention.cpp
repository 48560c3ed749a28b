// Paged attention for CPUs: reads K/V straight from the cache blocks (no gather copy), threaded over (tile of a
// request's query tokens x KV head), W keys per vector (K blocks stored transposed) and W head dims per vector for V.
// A tile of several tokens (a verify step, a chunk with cached context) reads each KV block once for all its tokens.
// A quantized cache (C an is_code type: int8 / fp8 codes) has rows of D codes + their scales (int8: a float16 per 16
// channels; fp8: a float32 per row): the codes widen in registers and are scaled there (int8: each group's keys by a
// vector of their scales; fp8: the scores by the keys' scales), V rows by their W-lane chunk's scale (no float copy).
#include "simd.h"

namespace pagemill {
namespace PAGEMILL_ISA {
namespace {

// A quantized cache's scale type and channels per scale (kernels.h, attention/kv_quant.py; int8's last group is
// partial when D is not a multiple of 16).
template <typename C>
struct kv_scale {
  using type = float;
};
template <>
struct kv_scale<i8q> {
  using type = f16;
};
template <typename C>
using kv_scale_t = typename kv_scale<C>::type;
template <typename C>
constexpr int64_t kv_group(int64_t D) {
  return std::is_same<C, i8q>::value ? kKvInt8Group : D;
}
static_assert(kKvInt8Group % W == 0, "a V row's W-lane chunk must lie in one scale group");
template <typename S>
inline float load_scale(const void* p) {
  S s;
  memcpy(&s, p, sizeof(S));
  return to_f32(s);
}

// Query heads per KV head handled in registers at once: G x U score accumulators must fit the register file.
constexpr int kMaxGroup = kVecRegs >= 32 ? 8 : 4;

// Blocks sit anywhere in the cache, so the hardware prefetcher cannot see the next one coming: ask for it.
inline void prefetch_rows(const void* p, int64_t rows, int64_t row_bytes, int64_t stride_bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < row_bytes; b += 64) prefetch_l1(c + r * stride_bytes + b);
}

// v, kept in a register: stops the compiler from folding a vector used by several FMAs into each of them as a memory
// operand (one load per FMA instead of one in all, and the loads, not the FMAs, then bound the loop).
inline vf in_register(vf v) {
#if defined(__AVX512F__) || defined(__AVX2__)
  asm("" : "+v"(v));
#endif
  return v;
}

// Scores of G query heads (q: [G, D]) against `nk` (<= W) keys from c0 of one block's K, stored transposed ([D, BS]
// for this head): each step loads W keys' d-th element and FMAs it with every head's q[d], so no horizontal sums.
// `next` (nullptr: none) is the next block's K for this head: each K row loaded here has the same row of that block
// prefetched into L2, spread over the loop (the blocks sit anywhere, and a burst of a whole block's prefetches at
// once stalls the core on its miss buffers: measured ~13 GB/s per core against 30 for a plain stream).
// `kscale`: a quantized cache's scales ([ceil(D / gs), BS] for this block and head) from key c0 on (nullptr for a
// float cache); gs channels per scale (gs < D: each group's W keys are multiplied by their scales as they load;
// gs >= D: the scores are).
template <int G, typename C>
inline void qk_chunk(const float* __restrict q, const C* __restrict kt, int64_t D, int64_t BS, int64_t c0,
                     int64_t nk, float scale, float* __restrict scores, int64_t n, const C* next,
                     const kv_scale_t<C>* __restrict kscale, int64_t gs) {
  // U partial sums per head over interleaved d break the FMA latency chain (64 dependent FMAs otherwise).
  constexpr int U = G * 4 + 2 <= kVecRegs ? 4 : 2;
  vf acc[G][U];
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < U; ++u) acc[g][u] = vzero();
  vf sc = vset(scale);
  if (is_code<C>::value && gs < D) {
    for (int64_t d0 = 0; d0 < D; d0 += gs) {
      const vf ks = in_register(vloadn(kscale + (d0 / gs) * BS, nk));
      const int64_t e = imin(d0 + gs, D);  // a partial last group when D is not a multiple of gs
      int64_t d = d0;
      for (; d + U <= e; d += U)
        for (int u = 0; u < U; ++u) {
          if (next) prefetch_l2(next + (d + u) * BS + c0);
          const vf k = in_register(vmul(vloadn(kt + (d + u) * BS + c0, nk), ks));
          for (int g = 0; g < G; ++g) acc[g][u] = vfma(vset(q[g * D + d + u]), k, acc[g][u]);
        }
      for (; d < e; ++d) {
        const vf k = vmul(vloadn(kt + d * BS + c0, nk), ks);
        for (int g = 0; g < G; ++g) acc[g][0] = vfma(vset(q[g * D + d]), k, acc[g][0]);
      }
    }
  } else {
    int64_t d = 0;
    for (; d + U <= D; d += U)
      for (int u = 0; u < U; ++u) {
        if (next) prefetch_l2(next + (d + u) * BS + c0);
        const vf k = in_register(vloadn(kt + (d + u) * BS + c0, nk));
        for (int g = 0; g < G; ++g) acc[g][u] = vfma(vset(q[g * D + d + u]), k, acc[g][u]);
      }
    for (; d < D; ++d) {
      const vf k = vloadn(kt + d * BS + c0, nk);
      for (int g = 0; g < G; ++g) acc[g][0] = vfma(vset(q[g * D + d]), k, acc[g][0]);
    }
    if constexpr (is_code<C>::value) sc = vmul(sc, vloadn(kscale, nk));
  }
  for (int g = 0; g < G; ++g) {
    vf sum = acc[g][0];
    for (int u = 1; u < U; ++u) sum = vadd(sum, acc[g][u]);
    vstoren(scores + g * n, vmul(sum, sc), nk);
  }
}

// acc[g, d0 : d0 + U W] += sum_j p[g, j] * V[j, d0 : d0 + U W] over `count` keys whose rows start at v (stride vs);
// the U W-lane chunks of each row are independent FMA chains.
// `next` (nullptr: none): the next block's V rows for this head, prefetched into L2 as qk_chunk does for K.
// A quantized row's D codes are followed by its scales, one per gs channels: each W-lane chunk is multiplied by its
// group's scale in registers.
template <int G, typename C>
inline void pv_chunk(const float* __restrict p, int64_t n, const C* __restrict v, int64_t vs, int64_t count,
                     int64_t d0, int64_t D, float* __restrict acc, const C* next, int64_t gs) {
  using S = kv_scale_t<C>;  // (float for a float cache: no scales read)
  constexpr int U = G * 4 + 2 <= kVecRegs ? 4 : 2;
  int64_t len[U];
  for (int u = 0; u < U; ++u) len[u] = imax(0, D - d0 - W * u);
  vf a[G][U];
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < U; ++u) a[g][u] = len[u] ? vloadn(acc + g * D + d0 + W * u, len[u]) : vzero();
  for (int64_t j = 0; j < count; ++j) {
    const C* row = v + j * vs + d0;
    for (int u = 0; u < U; ++u) {
      if (!len[u]) break;
      if (next) prefetch_l2(next + j * vs + d0 + W * u);
      vf x = vloadn(row + W * u, len[u]);
      if constexpr (is_code<C>::value)
        x = vmul(x, vset(load_scale<S>(v + j * vs + D + (d0 + W * u) / gs * int64_t(sizeof(S)))));
      x = in_register(x);
      for (int g = 0; g < G; ++g) a[g][u] = vfma(vset(p[g * n + j]), x, a[g][u]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < U; ++u)
      if (len[u]) vstoren(acc + g * D + d0 + W * u, a[g][u], len[u]);
}

// Query tokens of one tile (consecutive tokens of one request) against one KV head: token i's G query heads are at
// q + i * qs, its output at out + i * os, and it attends to keys [lo[i], hi[i]) of the request (lo and hi rise
// with i).
// Each K chunk and V block is read once for the whole tile (it stays in L1 while every token uses it), and every
// token's arithmetic is exactly that of the token alone (same chunks, same order), so a verify step's rows equal
// the one-token decodes bit for bit. Scores are computed for whole chunks of min(W, BS) keys; the extra keys of a
// partial chunk are ignored. A token may have no keys (lo == hi: a part of the context it does not reach): its output
// is zeros. `stats` (nullptr: not wanted): each (token, head)'s softmax max and sum, for merging parts.
template <typename C, typename O>
inline void attend_tile(const float* __restrict q, O* __restrict out, int64_t qs, int64_t os, int64_t nt,
                        const int64_t* __restrict lo, const int64_t* __restrict hi, const C* __restrict k_cache,
                        const C* __restrict v_cache, const int64_t* __restrict block_row, int64_t G, int64_t D,
                        int64_t Hk, int64_t h, int64_t BS, float scale, Scratch& score_buf, Scratch& acc_buf,
                        Scratch& index_buf, float* __restrict stats = nullptr) {
  // Token i's scores sit at scores + off[i] + g * n[i]; score index j is key first[i] + j (room for whole chunks).
  int64_t* first = reinterpret_cast<int64_t*>(index_buf.get(3 * nt * 2));
  int64_t* n = first + nt;
  int64_t* off = n + nt;
  int64_t total = 0;
  for (int64_t i = 0; i < nt; ++i) {
    first[i] = (lo[i] / BS) * BS;
    n[i] = round_up(hi[i] - first[i], BS) + W;
    off[i] = total;
    total += G * n[i];
  }
  float* scores = score_buf.get(total);
  float* acc = acc_buf.get(nt * G * D);
  for (int64_t i = 0; i < nt * G * D; ++i) acc[i] = 0.0f;
  // A quantized row is D codes + ns scales; a quantized K block is [Hk, D, BS] codes then [Hk, ns, BS] scales.
  using S = kv_scale_t<C>;
  const int64_t gs = kv_group<C>(D), ns = (D + gs - 1) / gs;
  const int64_t Dp = is_code<C>::value ? D + ns * int64_t(sizeof(S)) : D;
  const int64_t block_elems = BS * Hk * Dp, start = first[0], end = hi[nt - 1];
  for (int64_t b0 = start; b0 < end; b0 += BS) {
    const C* kt = k_cache + block_row[b0 / BS] * block_elems + h * D * BS;
    const S* ks = is_code<C>::value ? reinterpret_cast<const S*>(kt - h * D * BS + Hk * D * BS) + h * ns * BS
                                    : nullptr;
    const C* next_kt = b0 + BS < end ? k_cache + block_row[b0 / BS + 1] * block_elems + h * D * BS : nullptr;
    if (!next_kt)  // the first V block, while the last K block is used
      prefetch_rows(v_cache + block_row[start / BS] * block_elems + h * Dp, BS, Dp * int64_t(sizeof(C)),
                    Hk * Dp * int64_t(sizeof(C)));
    for (int64_t c0 = 0; c0 < BS && b0 + c0 < end; c0 += W) {
      const int64_t nk = imin(W, BS - c0);
      const C* next = next_kt;  // prefetched by the chunk's first token only
      for (int64_t i = 0; i < nt; ++i) {
        if (b0 < first[i] || b0 + c0 >= hi[i]) continue;
        float* s = scores + off[i] + (b0 + c0 - first[i]);
        for (int64_t g0 = 0; g0 < G; g0 += kMaxGroup)
          with_static_count<kMaxGroup>(int(imin(kMaxGroup, G - g0)), [&](auto g) {
            qk_chunk<decltype(g)::value>(q + i * qs + g0 * D, kt, D, BS, c0, nk, scale, s + g0 * n[i], n[i], next,
                                        ks ? ks + c0 : nullptr, gs);
          });
        next = nullptr;
      }
    }
  }
  // Softmax per query row over keys [lo, hi); the exp loop is vectorised (glibc's libmvec).
  for (int64_t i = 0; i < nt; ++i) {
    const int64_t skip = lo[i] - first[i], len = hi[i] - lo[i];
    for (int64_t g = 0; g < G; ++g) {
      float* s = scores + off[i] + g * n[i];
      for (int64_t j = 0; j < skip; ++j) s[j] = 0.0f;
      s += skip;
      float mx = -FLT_MAX;
#pragma omp simd reduction(max : mx)
      for (int64_t j = 0; j < len; ++j) mx = s[j] > mx ? s[j] : mx;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < len; ++j) {
        s[j] = expf(s[j] - mx);
        sum += s[j];
      }
      if (stats) stats[2 * (i * G + g)] = mx, stats[2 * (i * G + g) + 1] = sum;
      const float inv = 1.0f / sum;
#pragma omp simd
      for (int64_t j = 0; j < len; ++j) s[j] *= inv;
    }
  }
  const int64_t vs = Hk * Dp;
  constexpr int64_t kPvDims = 4 * W;  // dims per pv_chunk pass (U = 4 at most)
  for (int64_t b0 = start; b0 < end; b0 += BS) {
    const C* vb = v_cache + block_row[b0 / BS] * block_elems + h * Dp;
    const C* next = b0 + BS < end ? v_cache + block_row[b0 / BS + 1] * block_elems + h * Dp : nullptr;
    for (int64_t i = 0; i < nt; ++i) {
      if (b0 < first[i] || b0 >= hi[i]) continue;
      const int64_t count = imin(BS, hi[i] - b0);
      const float* s = scores + off[i] + (b0 - first[i]);
      float* a = acc + i * G * D;
      for (int64_t g0 = 0; g0 < G; g0 += kMaxGroup)
        with_static_count<kMaxGroup>(int(imin(kMaxGroup, G - g0)), [&](auto g) {
          constexpr int Gc = decltype(g)::value;
          constexpr int64_t step = (Gc * 4 + 2 <= kVecRegs ? 4 : 2) * W;
          static_assert(step <= kPvDims, "pv_chunk covers at most 4 W dims");
          for (int64_t d0 = 0; d0 < D; d0 += step)
            pv_chunk<Gc>(s + g0 * n[i], n[i], vb, vs, count, d0, D, a + g0 * D, g0 == 0 ? next : nullptr, gs);
        });
      next = nullptr;
    }
  }
  for (int64_t i = 0; i < nt; ++i) {
    const float* a = acc + i * G * D;
    O* o = out + i * os;
    for (int64_t j = 0; j < G * D; j += W) vstoren(o + j, vloadn(a + j, G * D - j), G * D - j);
  }
}

// Most tokens of one request a work item takes: its scores (tokens x G x context) stay in L2.
constexpr int64_t kMaxTileTokens = 8;

// Tokens per tile: the largest up to kMaxTileTokens whose (tile x KV head) items split evenly over the threads, as
// long as there are few items (with many, dynamic scheduling balances them anyway).
int64_t tile_tokens(const PagedAttentionArgs& a) {
  const int64_t threads = imax(1, a.num_threads);
  for (int64_t tile = kMaxTileTokens; tile > 1; --tile) {
    int64_t items = 0;
    for (int64_t r = 0; r < a.B; ++r) items += (a.query_start_loc[r + 1] - a.query_start_loc[r] + tile - 1) / tile;
    items *= a.Hk;
    if (items % threads == 0 || items >= 4 * threads) return tile;
  }
  return 1;
}

// Keys per context part: a token's context is attended in parts at fixed key positions [p P, (p + 1) P), merged in
// part order, so its arithmetic depends on the token alone (not on the batch, the tile, or which thread ran a part).
// A short context is one part, whose merge is exact (weight l / l = 1): the same bits as without parts.
constexpr int64_t kContextPart = 512;

// A token's output out[G, D] from its parts' outputs (part p's [G, D] at acc + p * acc_stride, each normalised by
// its own softmax) weighted by their softmax mass l_p exp(m_p - max m), in part order; part p's (m, l) per head at
// stats + p * stats_stride + 2 g. Empty parts (l = 0) weigh nothing. o: room for D floats.
// (Not inlined: one compiled form for both schedules, so -ffast-math cannot make their bits differ.)
template <typename O>
__attribute__((noinline)) void merge_parts(const float* __restrict acc, int64_t acc_stride,
                                           const float* __restrict stats, int64_t stats_stride, int64_t parts,
                                           int64_t G, int64_t D, O* __restrict out, float* __restrict o) {
  for (int64_t g = 0; g < G; ++g) {
    auto m = [&](int64_t p) { return stats[p * stats_stride + 2 * g]; };
    auto l = [&](int64_t p) { return stats[p * stats_stride + 2 * g + 1]; };
    // (no infinities under -ffast-math: an empty part's max, -FLT_MAX, never enters an exp)
    float mx = -FLT_MAX, total = 0.0f;
    for (int64_t p = 0; p < parts; ++p)
      if (l(p) != 0.0f) mx = fmaxf(mx, m(p));
    for (int64_t p = 0; p < parts; ++p)
      if (l(p) != 0.0f) total += l(p) * expf(m(p) - mx);
    for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
    for (int64_t p = 0; p < parts; ++p) {
      if (l(p) == 0.0f) continue;
      const float w = l(p) * expf(m(p) - mx) / total;
      const float* x = acc + p * acc_stride + g * D;
      for (int64_t d = 0; d < D; ++d) o[d] += w * x[d];
    }
    for (int64_t j = 0; j < D; j += W) vstoren(out + g * D + j, vloadn(o + j, D - j), D - j);
  }
}

// Every (tile of a request's query tokens, KV head) pair, scheduled dynamically over the threads: an item's cost is
// its context length, which varies a lot within a batch (static halves left one thread idle while the other did
// the long sequences). A request's tokens are split into equal tiles of at most tile_tokens(). With few pairs (one
// long sequence has Hk of them: 3 KV heads on 2 threads left one idle a third of the time) the pairs' context parts
// are the items, their outputs merged in a second pass; with many, each pair takes its parts in turn.
template <typename C, typename O>
void attend_all(const PagedAttentionArgs& a) {
  const float* qp = a.q;
  O* op = static_cast<O*>(a.out);
  const C* kc = static_cast<const C*>(a.k_cache);
  const C* vc = static_cast<const C*>(a.v_cache);
  const int64_t Hq = a.Hq, Hk = a.Hk, D = a.D, G = Hq / Hk, tile = tile_tokens(a);
  const int64_t P = round_up(kContextPart, a.BS);
  // tiles[3 j .. 3 j + 2]: first token, token count and context parts of tile j (a request's tiles as equal as can be)
  Scratch tile_buf;
  int64_t* tiles = reinterpret_cast<int64_t*>(tile_buf.get(6 * imax(1, a.T)));
  int64_t num_tiles = 0, max_parts = 1;
  for (int64_t r = 0; r < a.B; ++r) {
    const int64_t t0 = a.query_start_loc[r], len = a.query_start_loc[r + 1] - t0;
    if (len <= 0) continue;
    const int64_t pieces = (len + tile - 1) / tile, per = (len + pieces - 1) / pieces;
    for (int64_t s = 0; s < len; s += per, ++num_tiles) {
      const int64_t nt = imin(per, len - s), keys = a.context_lens[r] + s + nt;  // the tile's last token's keys
      tiles[3 * num_tiles] = t0 + s, tiles[3 * num_tiles + 1] = nt, tiles[3 * num_tiles + 2] = (keys + P - 1) / P;
      max_parts = imax(max_parts, tiles[3 * num_tiles + 2]);
    }
  }
  const int64_t pairs = num_tiles * Hk;
  const bool split = max_parts > 1 && pairs < 4 * int64_t(a.num_threads);
  // Part p of pair w: its tokens' outputs [nt][G][D] at out (token stride G D) and (m, l) stats [nt][G][2] at stats,
  // or the outputs straight into the result (stats == nullptr: the pair's only part).
  auto attend_part = [&](int64_t w, int64_t p, float* out, float* stats, Scratch& scores, Scratch& acc,
                         Scratch& index, Scratch& bound_buf) {
    const int64_t* tl = tiles + 3 * (w / Hk);
    const int64_t t0 = tl[0], nt = tl[1], h = w % Hk, r = a.token_request[t0];
    int64_t* lo = reinterpret_cast<int64_t*>(bound_buf.get(4 * nt));
    int64_t* hi = lo + nt;
    for (int64_t i = 0; i < nt; ++i) {  // the token's keys [lo, hi) within the part (empty if it does not reach it)
      const int64_t pos = a.context_lens[r] + t0 + i - a.query_start_loc[r];
      const int64_t first = a.window > 0 ? imax(0, pos - a.window + 1) : 0;
      lo[i] = imin(imax(first, p * P), (p + 1) * P), hi[i] = imin(imax(pos + 1, p * P), (p + 1) * P);
    }
    const float* q = qp + (t0 * Hq + h * G) * D;
    const int64_t* block_row = a.block_tables + r * a.MB;
    if (!stats)
      return attend_tile(q, op + (t0 * Hq + h * G) * D, Hq * D, Hq * D, nt, lo, hi, kc, vc, block_row, G, D, Hk,
                         h, a.BS, a.scale, scores, acc, index);
    if (lo[nt - 1] == hi[nt - 1]) {  // no token reaches this part (a window's start is past it)
      for (int64_t i = 0; i < nt * G; ++i) stats[2 * i] = -FLT_MAX, stats[2 * i + 1] = 0.0f;
      return;
    }
    attend_tile(q, out, Hq * D, G * D, nt, lo, hi, kc, vc, block_row, G, D, Hk, h, a.BS, a.scale, scores, acc, index,
                stats);
  };
  // Pair w's tokens' outputs from its np parts (part p at out + p * part_out, stats + p * part_stats).
  auto merge_pair = [&](int64_t w, int64_t np, const float* out, int64_t part_out, const float* stats,
                        int64_t part_stats, Scratch& row) {
    const int64_t* tl = tiles + 3 * (w / Hk);
    const int64_t t0 = tl[0], nt = tl[1], h = w % Hk;
    for (int64_t i = 0; i < nt; ++i)
      merge_parts(out + i * G * D, part_out, stats + i * G * 2, part_stats, np, G, D,
                  op + ((t0 + i) * Hq + h * G) * D, row.get(D));
  };
  // Split: part slots of every pair, [pairs][max_parts] x (tile x G x D outputs, then tile x G x 2 stats).
  const int64_t slot = tile * G * (D + 2);
  Scratch part_buf;
  float* parts = split ? part_buf.get(pairs * max_parts * slot) : nullptr;
  const int64_t items = split ? pairs * max_parts : pairs;
#pragma omp parallel num_threads(a.num_threads) if (items > 1)
  {
    Scratch scores, acc, index, bound_buf, own, row;
    if (split) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t u = 0; u < items; ++u) {
        const int64_t w = u / max_parts, p = u % max_parts;
        if (p >= tiles[3 * (w / Hk) + 2]) continue;
        float* s = parts + u * slot;
        attend_part(w, p, s, s + tile * G * D, scores, acc, index, bound_buf);
      }
#pragma omp for schedule(dynamic, 1)
      for (int64_t w = 0; w < pairs; ++w) {
        const float* s = parts + w * max_parts * slot;
        merge_pair(w, tiles[3 * (w / Hk) + 2], s, slot, s + tile * G * D, slot, row);
      }
    } else {
#pragma omp for schedule(dynamic, 1)
      for (int64_t w = 0; w < pairs; ++w) {
        const int64_t nt = tiles[3 * (w / Hk) + 1], np = tiles[3 * (w / Hk) + 2];
        if (np == 1) {
          attend_part(w, 0, nullptr, nullptr, scores, acc, index, bound_buf);
          continue;
        }
        const int64_t part_out = nt * G * D, part_stats = nt * G * 2;
        float* s = own.get(np * (part_out + part_stats));
        for (int64_t p = 0; p < np; ++p)
          attend_part(w, p, s + p * part_out, s + np * part_out + p * part_stats, scores, acc, index, bound_buf);
        merge_pair(w, np, s, part_out, s + np * part_out, part_stats, row);
      }
    }
  }
}

}  // namespace

void paged_attention(const PagedAttentionArgs& a) {
  with_float_type(a.out_dtype, [&](auto o) {
    using O = decltype(o);
    switch (a.kv_quant) {
      case KvQuant::INT8: return attend_all<i8q, O>(a);
      case KvQuant::FP8_E4M3: return attend_all<e4m3, O>(a);
      case KvQuant::FP8_E5M2: return attend_all<e5m2, O>(a);
      case KvQuant::NONE: break;
    }
    with_float_type(a.cache_dtype, [&](auto c) { attend_all<decltype(c), O>(a); });
  });
}

}  // namespace PAGEMILL_ISA
}  // namespace pagemill
