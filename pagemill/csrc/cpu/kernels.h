// The boundary between the torch bindings (compiled once, baseline flags) and the ISA variants of the kernels
// (compiled once per ISA with explicit flags, see pagemill/kernels/build.py). Plain C types only: the variants
// include no torch header, so no inline function compiled for one ISA can leak into another through the linker.
#pragma once
#include <cstdint>

namespace pagemill {

enum class DType : int32_t { F32 = 0, F16 = 1, BF16 = 2 };
// A quantized KV cache's codes (pagemill/attention/kv_quant.py): rows of D one-byte codes, then their scales: int8
// one float16 scale per kKvInt8Group channels (the last group partial when D is not a multiple), fp8 one float32
// scale per row.
enum class KvQuant : int32_t { NONE = 0, INT8 = 1, FP8_E4M3 = 2, FP8_E5M2 = 3 };
constexpr int64_t kKvInt8Group = 16;
// Bytes of one quantized (token, KV head) row of head_dim D (D itself for NONE: elements of the float dtype).
inline int64_t kv_row_width(KvQuant q, int64_t D) {
  return q == KvQuant::NONE ? D : q == KvQuant::INT8 ? D + (D + kKvInt8Group - 1) / kKvInt8Group * 2 : D + 4;
}

// out, q: [T, Hq, D] (q fp32). Caches: [num_blocks, BS, Hk, D] extents; V blocks [BS, Hk, D], K blocks stored
// transposed [Hk, D, BS] (quantized: rows kv_row_width wide; K blocks [Hk, D, BS] codes then [Hk, D / group, BS]
// scales). block_tables [B, MB]; query_start_loc [B + 1]; context_lens [B] (tokens cached before
// this step); token i of request r sits at position context_lens[r] + i - query_start_loc[r].
struct PagedAttentionArgs {
  void* out;
  DType out_dtype;
  const float* q;
  const void* k_cache;
  const void* v_cache;
  DType cache_dtype;
  KvQuant kv_quant;  // NONE: cache_dtype; else the cache holds quantized rows (K blocks: codes, then scales)
  const int64_t* block_tables;
  const int64_t* query_start_loc;
  const int64_t* context_lens;
  const int64_t* token_request;  // [T]: the request of each token
  int64_t T, B, Hq, Hk, D, BS, MB, window;
  float scale;
  int num_threads;
};

// q_out [T, Hq, D], k_out / v_out [T, Hk, D] fp32; qkv [T, (Hq + 2 Hk) D]; cos / sin [max_pos, D] fp32; the first
// n_cached tokens are written to the cache slots (K transposed per block). q_norm / k_norm: Qwen3 / Gemma 3's QK norm.
struct RopeCacheArgs {
  float* q_out;
  float* k_out;
  float* v_out;
  const void* qkv;
  DType qkv_dtype;
  const int64_t* positions;
  const float* cos;
  const float* sin;
  void* k_cache;
  void* v_cache;
  DType cache_dtype;
  KvQuant kv_quant;  // NONE: a cache_dtype cache; else rows quantized as kv_rows.h writes them (k_out / v_out of
                     // the cached tokens then hold the values as stored)
  const int64_t* slot_mapping;
  const float* q_norm;  // [D] per-head RMSNorm scale applied to q before RoPE (nullptr: none); k_norm likewise
  const float* k_norm;
  float norm_eps;
  int64_t T, Hq, Hk, D, BS, n_cached;
  int num_threads;
};

// The bit-plane record formats of gemv_records: Q4_1 / Q5_1 (also Q4_0 / Q5_0) per group of 32, and the K-quants'
// super-blocks of 256 (groups of 32; Q6_K, Q2_K, Q3_K 16).
enum class RecordFormat : int32_t { Q4_1 = 0, Q5_1 = 1, Q4_K = 2, Q5_K = 3, Q6_K = 4, Q2_K = 5, Q3_K = 6 };

// out [M, N] (fp32 or fp16) = x [M, K] (fp32) W^T + bias; W packed in tiles of 64 output channels.
// Whether this core runs 512-bit vector ops as two 256-bit halves (AMD Zen 4): the one-row float kernels then
// unpack 4-6 bit weights with unpacks and shifts instead of byte permutes. From CPUID when the module loads;
// set_split_zmm_units overrides it (tests run both forms on every CPU).
bool split_zmm_units();

struct GemvArgs {
  void* out;
  DType out_dtype;
  const float* x;
  const float* bias;  // nullptr: none
  int64_t M, K, N, tiles;
  int num_threads;
  // Every row on the direct path (streamed weights, 16 rows at a time), never the fp32 panels of many-row calls: one
  // summation order per row whatever M (gemv_int8 / gemv_records; the batch-invariant mode)
  bool direct_only = false;
  // x quantized to int8 per row and block of 32 and multiplied in integers (linear_dtype="int8"; 4-bit records and
  // int8 tiles: variant/gemv_i8.cpp), else the float kernels
  bool int8_activations = false;
};

// The LM head's greedy screen (variant/head_screen.cpp): logits [M, N] fp32, exact (float32, from `table` [N, K])
// wherever a row's maximum may be, int8 approximations elsewhere. Weights from pack_head_screen: q [T, K / 4, 64, 4]
// int8, scales and offsets [T, K / 32, 64]; bounds [T, 2, 64]: each channel's |w - w~| and |w~| (rounded up).
struct HeadScreenArgs {
  float* logits;
  const float* x;
  const int8_t* q;
  const float* scales;
  const int32_t* offsets;
  const float* table;  // the float32 [N, K] head, or nullptr: rows come from table_rows
  // Where the head has no float32 table (a quantized head): table_rows(table_rows_src, rows, n, out) writes rows
  // rows[0 .. n) as float32 to out [n, K] (gguf_rows.h: the file's blocks, decoded with gguf.quants' arithmetic)
  void (*table_rows)(const void* src, const int64_t* rows, int64_t n, float* out) = nullptr;
  const void* table_rows_src = nullptr;
  int64_t* argmax;  // [M] the rows' argmax tokens (first maximum), or nullptr
  // Structured output: int32 bitmask [R, mask_words] (bit set = allowed) and the bitmask row of each x row (-1: no
  // mask), or nullptr: a masked row's maximum and argmax are taken over its allowed tokens
  const int32_t* bitmask = nullptr;
  const int64_t* mask_rows = nullptr;
  int64_t mask_words = 0;
  const float* bounds;
  int64_t M, K, N, tiles;
  int num_threads;
};

// The multi-LoRA delta (variant/lora.cpp): y [T, N] += (x[a:b] @ lora_a[s]) @ lora_b[s] for each run (a, b, s) of
// runs [num_runs, 3] (sorted, disjoint, within [0, T)); lora_a [S, K, width], lora_b [S, width, N]; all fp32.
struct LoraArgs {
  float* y;
  const float* x;
  const float* lora_a;
  const float* lora_b;
  const int32_t* runs;
  int64_t T, K, N, width, num_runs;
  int num_threads;
};

struct KernelTable {
  const char* name;
  void (*paged_attention)(const PagedAttentionArgs&);
  void (*rms_norm)(void* out, DType out_dtype, const void* x, DType x_dtype, const float* weight, int64_t T,
                   int64_t H, float eps, int num_threads);
  void (*fused_add_rms_norm)(void* out, DType out_dtype, const void* x, DType x_dtype, float* residual,
                             const float* weight, int64_t T, int64_t H, float eps, int num_threads);
  void (*silu_and_mul)(void* out, DType out_dtype, const void* x, DType x_dtype, int64_t T, int64_t I,
                       int num_threads);
  void (*rope_and_cache)(const RopeCacheArgs&);
  void (*gemv_f16)(const GemvArgs&, const uint16_t* packed);  // [tiles, K, 64] fp16 bits
  // q [tiles, Kp, 64] int8, scales and mins (nullptr: none) [tiles, Kp / G, 64] fp32: w = q * scale + min
  void (*gemv_int8)(const GemvArgs&, const int8_t* q, const float* scales, const float* mins, int64_t Kp, int64_t G);
  // Q4_1 records [tiles, K / G, G / 2 * 64 + 256] bytes
  void (*gemv_q4)(const GemvArgs&, const uint8_t* packed, int64_t G);
  // GGUF bit-plane records [tiles, K / (GR G), record bytes] (layouts: variant/gemv.cpp, sizes: record_bytes())
  void (*gemv_records)(const GemvArgs&, const uint8_t* packed, RecordFormat format);
  int64_t (*head_screen)(const HeadScreenArgs&);  // returns how many logits were recomputed exactly
  // structured output: -inf where the int32 bitmask [R, W] disallows a token, in logits rows `rows` of [*, V]
  void (*apply_token_bitmask)(float* logits, int64_t V, const int32_t* bitmask, int64_t W, const int64_t* rows,
                              int64_t R, int num_threads);
  // fp32 W [tiles, K, 64] in a fixed reduction order: a row's result does not depend on M (batch-invariant mode)
  void (*gemv_f32)(const GemvArgs&, const float* packed);
  // as silu_and_mul with GELU-tanh (Gemma's GeGLU)
  void (*gelu_tanh_and_mul)(void* out, DType out_dtype, const void* x, DType x_dtype, int64_t T, int64_t I,
                            int num_threads);
  void (*lora_delta)(const LoraArgs&);
  void (*gemv_bf16)(const GemvArgs&, const uint16_t* packed);  // [tiles, K, 64] bf16 bits
};

// One per compiled variant (see build.py); the bindings pick one at load time.
const KernelTable* kernel_table_avx512_vbmi();
const KernelTable* kernel_table_avx512();
const KernelTable* kernel_table_avx2();
const KernelTable* kernel_table_generic();

}  // namespace pagemill
