// The multi-LoRA delta of one linear for a whole step, in one call: for each run (a, b, s) of tokens that use
// adapter slot s,
//
//     y[a:b] += (x[a:b] @ A[s]) @ B[s]        x [T, K], A [S, K, Wd], B [S, Wd, N], y [T, N]; fp32
//
// Both products are one register-blocked kernel, C[rows, cols] (+)= X[rows, :] @ M[:, cols] with M row-major:
// a block of up to MR rows and NV vectors of columns keeps its accumulators in registers while the k loop
// streams M's rows (W-wide axpys), so each adapter's A and B are read once per block of rows. Threads split the
// shrink (x @ A) by (run, row block) and, after a barrier, the expand (t @ B) by column blocks, so each thread reads
// only its columns of B and no two threads write the same y element. Replaces ~8 tiny torch matmuls per adapter
// per layer, whose per-op overhead dominated multi-LoRA decode.
#include "simd.h"

namespace pagemill {
namespace PAGEMILL_ISA {
namespace {

// Rows and column vectors per register block: MR * NV accumulators + NV loads + a broadcast fit the registers.
constexpr int MR = kVecRegs >= 32 ? 6 : 3;
constexpr int NV = kVecRegs >= 32 ? 4 : 3;
constexpr int64_t NCOL = int64_t(NV) * W;  // columns per block
constexpr int64_t kSerialMacs = 1 << 16;  // below this many multiply-adds one thread is faster than waking two

// c[r, 0:n] (+)= sum_k x[r, k] m[k, 0:n] for R rows; V = ceil(n / W) <= NV vectors (the last one partial).
template <int R, int V, bool Accumulate>
inline void block(const float* x, int64_t ldx, const float* m, int64_t ldm, int64_t K, float* c, int64_t ldc,
                  int64_t n) {
  vf acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = Accumulate ? vloadn(c + r * ldc + v * W, n - v * W) : vzero();
  for (int64_t k = 0; k < K; ++k) {
    const float* mk = m + k * ldm;
    vf mv[V];
    for (int v = 0; v < V; ++v) mv[v] = vloadn(mk + v * W, n - v * W);
    for (int r = 0; r < R; ++r) {
      const vf xb = vset(x[r * ldx + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = vfma(xb, mv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v + 1 < V; ++v) vstore(c + r * ldc + v * W, acc[r][v]);
    vstoren(c + r * ldc + (V - 1) * W, acc[r][V - 1], n - (V - 1) * W);
  }
}

// The same for `rows` <= MR rows and n <= NCOL columns (runtime sizes to compile-time ones).
template <bool Accumulate>
void block_any(const float* x, int64_t ldx, const float* m, int64_t ldm, int64_t K, float* c, int64_t ldc,
               int rows, int64_t n) {
  with_static_count<MR>(rows, [&](auto R) {
    with_static_count<NV>(int((n + W - 1) / W), [&](auto V) {
      block<decltype(R)::value, decltype(V)::value, Accumulate>(x, ldx, m, ldm, K, c, ldc, n);
    });
  });
}

// Row blocks of a run of n rows: ceil(n / MR) blocks of near-equal size (8 rows: 4 + 4, not 6 + 2).
inline int64_t row_blocks(int64_t n) { return (n + MR - 1) / MR; }
inline int64_t block_start(int64_t n, int64_t blocks, int64_t i) { return i * n / blocks; }

}  // namespace

void lora_delta(const LoraArgs& a) {
  const int64_t K = a.K, N = a.N, Wd = a.width;
  // The shrink's work items: (run, row block), flattened; item_run / item_block index them.
  int64_t items = 0, rows = 0;
  for (int64_t i = 0; i < a.num_runs; ++i) {
    const int64_t n = a.runs[3 * i + 1] - a.runs[3 * i];
    items += row_blocks(n);
    rows += n;
  }
  if (items == 0 || Wd == 0 || N == 0) return;
  int64_t* item_run = static_cast<int64_t*>(malloc(sizeof(int64_t) * size_t(2 * items)));
  int64_t* item_block = item_run + items;
  for (int64_t i = 0, j = 0; i < a.num_runs; ++i) {
    const int64_t blocks = row_blocks(a.runs[3 * i + 1] - a.runs[3 * i]);
    for (int64_t b = 0; b < blocks; ++b, ++j) item_run[j] = i, item_block[j] = b;
  }
  float* t = static_cast<float*>(malloc(sizeof(float) * size_t(a.T * Wd)));  // x @ A per token (rows in runs only)
  const int64_t col_blocks = (N + NCOL - 1) / NCOL;

  auto body = [&](int64_t tid, int64_t nth) {
    for (int64_t j = tid * items / nth; j < (tid + 1) * items / nth; ++j) {
      const int32_t* run = a.runs + 3 * item_run[j];
      const int64_t n = run[1] - run[0], blocks = row_blocks(n);
      const int64_t r0 = run[0] + block_start(n, blocks, item_block[j]);
      const int64_t r1 = run[0] + block_start(n, blocks, item_block[j] + 1);
      const float* A = a.lora_a + int64_t(run[2]) * K * Wd;
      for (int64_t c0 = 0; c0 < Wd; c0 += NCOL)
        block_any<false>(a.x + r0 * K, K, A + c0, Wd, K, t + r0 * Wd + c0, Wd, int(r1 - r0), imin(NCOL, Wd - c0));
    }
    if (nth > 1) {
#pragma omp barrier
    }
    const int64_t cb0 = tid * col_blocks / nth, cb1 = (tid + 1) * col_blocks / nth;
    for (int64_t i = 0; i < a.num_runs; ++i) {
      const int32_t* run = a.runs + 3 * i;
      const int64_t n = run[1] - run[0], blocks = row_blocks(n);
      const float* B = a.lora_b + int64_t(run[2]) * Wd * N;
      for (int64_t cb = cb0; cb < cb1; ++cb) {  // one column block of B stays in L1 across the run's row blocks
        const int64_t c0 = cb * NCOL;
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t r0 = run[0] + block_start(n, blocks, b), r1 = run[0] + block_start(n, blocks, b + 1);
          block_any<true>(t + r0 * Wd, Wd, B + c0, N, Wd, a.y + r0 * N + c0, N, int(r1 - r0), imin(NCOL, N - c0));
        }
      }
    }
  };

  const int64_t macs = rows * (K * Wd + Wd * N);
  const int nt = macs < kSerialMacs || omp_in_parallel() ? 1 : int(imax(1, imin(a.num_threads, col_blocks)));
  if (nt <= 1) {
    body(0, 1);
  } else {
#pragma omp parallel num_threads(nt)
    body(omp_get_thread_num(), omp_get_num_threads());
  }
  free(t);
  free(item_run);
}

}  // namespace PAGEMILL_ISA
}  // namespace pagemill
