// The Python module of pagemill's CPU kernels (plain pybind11: lower call overhead than torch.ops). Compiled with
// baseline flags: it checks tensors, then calls the kernel table of the active ISA variant, chosen at import as
// the best variant this CPU runs (set_isa switches it; PAGEMILL_CPU_ISA is applied by pagemill/kernels/build.py).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <atomic>
#include <string>
#include <vector>

#include "binding_utils.h"
#include "decoder_graph.h"
#include "gguf_rows.h"
#include "kernels.h"
#include "packing.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#define PAGEMILL_X86 1
#endif

namespace {

using pagemill::DType;
using pagemill::KernelTable;

#ifdef PAGEMILL_X86
// CPUID feature bits, each counted only when the OS saves the registers it needs (XCR0).
struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false, avx512 = false, avx512vbmi = false, avx512vnni = false, gfni = false;
};

CpuFeatures detect_cpu() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28);
  uint64_t xcr0 = 0;
  if (osxsave) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = (uint64_t(hi) << 32) | lo;
  }
  const bool os_avx = avx && (xcr0 & 0x6) == 0x6, os_avx512 = os_avx && (xcr0 & 0xE0) == 0xE0;
  f.fma = os_avx && (c & (1u << 12));
  f.f16c = os_avx && (c & (1u << 29));
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    f.avx2 = os_avx && (b & (1u << 5));
    f.avx512 = os_avx512 && (b & (1u << 16)) && (b & (1u << 17)) && (b & (1u << 30)) && (b & (1u << 31));  // F DQ BW VL
    f.avx512vbmi = f.avx512 && (c & (1u << 1));
    f.avx512vnni = f.avx512 && (c & (1u << 11));
    f.gfni = c & (1u << 8);
  }
  return f;
}

// AMD family 19h cores with AVX-512 (Zen 4) execute each 512-bit op as two 256-bit halves.
bool detect_split_zmm_units() {
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
  const bool amd = b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163;  // "AuthenticAMD"
  if (!amd || !__get_cpuid(1, &a, &b, &c, &d)) return false;
  const unsigned family = ((a >> 8) & 0xF) == 0xF ? 0xF + ((a >> 20) & 0xFF) : (a >> 8) & 0xF;
  return family == 0x19 && detect_cpu().avx512;
}
#else
bool detect_split_zmm_units() { return false; }
#endif

std::atomic<bool> split_zmm = detect_split_zmm_units();

struct Variant {
  const char* name;
  const KernelTable* (*table)();
  bool supported;
};

// Best first.
const std::vector<Variant>& variants() {
  static const std::vector<Variant> all = [] {
    std::vector<Variant> v;
#ifdef PAGEMILL_X86
    const CpuFeatures f = detect_cpu();
    const bool avx2 = f.avx2 && f.fma && f.f16c;
    // Ice Lake / Zen 4 and later: VBMI, GFNI and VNNI (int8 dot products) together.
    v.push_back({"avx512_vbmi", pagemill::kernel_table_avx512_vbmi,
                 avx2 && f.avx512 && f.avx512vbmi && f.gfni && f.avx512vnni});
    v.push_back({"avx512", pagemill::kernel_table_avx512, avx2 && f.avx512});
    v.push_back({"avx2", pagemill::kernel_table_avx2, avx2});
#endif
    v.push_back({"generic", pagemill::kernel_table_generic, true});
    return v;
  }();
  return all;
}

const KernelTable* best_table() {
  for (const auto& v : variants())
    if (v.supported) return v.table();
  return pagemill::kernel_table_generic();
}

const KernelTable* active = best_table();

}  // namespace

const KernelTable* pagemill::active_kernel_table() { return active; }

bool pagemill::split_zmm_units() { return split_zmm.load(std::memory_order_relaxed); }

namespace {

std::string isa() { return active->name; }

void set_isa(const std::string& name) {
  std::string names;
  for (const auto& v : variants()) {
    if (v.name == name) {
      TORCH_CHECK(v.supported, "kernel variant '", name, "' needs CPU features this machine lacks");
      active = v.table();
      return;
    }
    names += std::string(names.empty() ? "" : ", ") + v.name;
  }
  TORCH_CHECK(false, "unknown kernel variant '", name, "' (compiled: ", names, ")");
}

void set_split_zmm_units(bool on) { split_zmm.store(on, std::memory_order_relaxed); }

std::vector<std::string> compiled_isas() {
  std::vector<std::string> out;
  for (const auto& v : variants()) out.push_back(v.name);
  return out;
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
  for (const auto& v : variants())
    if (v.supported) out.push_back(v.name);
  return out;
}

}  // namespace

DType pagemill::dtype_of(const torch::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::F32;
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    default: TORCH_CHECK(false, what, ": unsupported dtype ", t.scalar_type());
  }
}

int pagemill::threads() { return at::get_num_threads(); }

pagemill::KvQuant pagemill::kv_quant_of(const torch::Tensor& cache) {
  switch (cache.scalar_type()) {
    case at::kChar: return pagemill::KvQuant::INT8;
    case at::kFloat8_e4m3fn: return pagemill::KvQuant::FP8_E4M3;
    case at::kFloat8_e5m2: return pagemill::KvQuant::FP8_E5M2;
    default: return pagemill::KvQuant::NONE;
  }
}

using pagemill::dtype_of;
using pagemill::kv_quant_of;
using pagemill::threads;

// out, q: [T, Hq, D] (q fp32; out fp32, fp16 or bf16: the dtype o_proj wants). k_cache, v_cache: [num_blocks,
// block_size, Hk, D] extents (fp32, fp16 or bf16, contiguous); K blocks are stored transposed ([Hk, D, block_size]).
void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor block_tables, torch::Tensor query_start_loc, torch::Tensor context_lens,
                     double scale, int64_t window) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32, "paged_attention: q must be float32");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_attention: K and V caches differ in dtype");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == torch::kInt64);
  TORCH_CHECK(query_start_loc.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64);
  pagemill::PagedAttentionArgs a;
  a.T = q.size(0), a.Hq = q.size(1), a.D = q.size(2), a.BS = k_cache.size(1), a.Hk = k_cache.size(2);
  a.MB = block_tables.size(1), a.B = context_lens.size(0), a.window = window;
  TORCH_CHECK(a.Hq % a.Hk == 0 && out.numel() == q.numel(), "paged_attention: shape mismatch");
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  std::vector<int64_t> tok_req(a.T);
  for (int64_t r = 0; r < a.B; ++r)
    for (int64_t t = qsl[r]; t < qsl[r + 1]; ++t) tok_req[t] = r;
  a.out = out.data_ptr(), a.out_dtype = dtype_of(out, "paged_attention out"), a.q = q.data_ptr<float>();
  a.k_cache = k_cache.data_ptr(), a.v_cache = v_cache.data_ptr();
  a.kv_quant = kv_quant_of(k_cache);
  a.cache_dtype = a.kv_quant == pagemill::KvQuant::NONE ? dtype_of(k_cache, "paged_attention cache") : DType::F32;
  TORCH_CHECK(k_cache.size(3) == pagemill::kv_row_width(a.kv_quant, a.D),
              "paged_attention: cache rows must be ", pagemill::kv_row_width(a.kv_quant, a.D),
              " wide (head_dim, or a quantized row: codes + scales, attention/kv_quant.py)");
  a.block_tables = block_tables.data_ptr<int64_t>(), a.query_start_loc = qsl;
  a.context_lens = context_lens.data_ptr<int64_t>(), a.token_request = tok_req.data();
  a.scale = static_cast<float>(scale), a.num_threads = threads();
  active->paged_attention(a);
}

void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && weight.is_contiguous());
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "rms_norm: weight must be float32");
  const int64_t H = x.size(-1), T = x.numel() / H;
  TORCH_CHECK(weight.numel() == H && out.numel() == x.numel(), "rms_norm: shape mismatch");
  active->rms_norm(out.data_ptr(), dtype_of(out, "rms_norm out"), x.data_ptr(), dtype_of(x, "rms_norm x"),
                   weight.data_ptr<float>(), T, H, static_cast<float>(eps), threads());
}

void fused_add_rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && residual.is_contiguous() && weight.is_contiguous());
  TORCH_CHECK(residual.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "fused_add_rms_norm: residual and weight must be float32");
  const int64_t H = x.size(-1), T = x.numel() / H;
  TORCH_CHECK(weight.numel() == H && out.numel() == x.numel() && residual.numel() == x.numel(),
              "fused_add_rms_norm: shape mismatch");
  active->fused_add_rms_norm(out.data_ptr(), dtype_of(out, "fused_add_rms_norm out"), x.data_ptr(),
                             dtype_of(x, "fused_add_rms_norm x"), residual.data_ptr<float>(), weight.data_ptr<float>(),
                             T, H, static_cast<float>(eps), threads());
}

// out = act(x[..., :I]) * x[..., I:] through the variant's `act_mul` (silu_and_mul or gelu_tanh_and_mul).
using ActMulFn = void (*)(void*, DType, const void*, DType, int64_t, int64_t, int);
void act_and_mul(ActMulFn act_mul, const char* name, torch::Tensor out, torch::Tensor x) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous());
  const int64_t I = out.size(-1), T = out.numel() / I;
  TORCH_CHECK(x.size(-1) == 2 * I && x.numel() == 2 * out.numel(), name, ": input last dim must be 2 * output last dim");
  act_mul(out.data_ptr(), dtype_of(out, "act_and_mul out"), x.data_ptr(), dtype_of(x, "act_and_mul x"), T, I,
          threads());
}

void silu_and_mul(torch::Tensor out, torch::Tensor x) { act_and_mul(active->silu_and_mul, "silu_and_mul", out, x); }

void gelu_tanh_and_mul(torch::Tensor out, torch::Tensor x) {
  act_and_mul(active->gelu_tanh_and_mul, "gelu_tanh_and_mul", out, x);
}

void rope_and_cache(torch::Tensor q_out, torch::Tensor k_out, torch::Tensor v_out, torch::Tensor qkv,
                    torch::Tensor positions, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                    torch::Tensor v_cache, torch::Tensor slot_mapping, c10::optional<torch::Tensor> q_norm,
                    c10::optional<torch::Tensor> k_norm, double norm_eps) {
  TORCH_CHECK(qkv.is_contiguous() && q_out.is_contiguous() && k_out.is_contiguous() && v_out.is_contiguous());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && cos.is_contiguous() && sin.is_contiguous());
  TORCH_CHECK(q_out.scalar_type() == at::kFloat && k_out.scalar_type() == at::kFloat &&
                  v_out.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rope_and_cache: q_out, k_out, v_out and cos/sin must be float32");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "rope_and_cache: K and V caches differ in dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong);
  TORCH_CHECK(positions.is_contiguous() && slot_mapping.is_contiguous(),
              "rope_and_cache: positions and slot_mapping must be contiguous");
  pagemill::RopeCacheArgs a;
  a.T = q_out.size(0), a.Hq = q_out.size(1), a.D = q_out.size(2), a.Hk = k_out.size(1);
  TORCH_CHECK(cos.size(1) == a.D && qkv.size(1) == (a.Hq + 2 * a.Hk) * a.D && a.D % 2 == 0,
              "rope_and_cache: shape mismatch");
  a.n_cached = slot_mapping.size(0), a.BS = k_cache.size(1);
  TORCH_CHECK(a.n_cached <= a.T && positions.numel() >= a.T, "rope_and_cache: shape mismatch");
  a.q_out = q_out.data_ptr<float>(), a.k_out = k_out.data_ptr<float>(), a.v_out = v_out.data_ptr<float>();
  a.qkv = qkv.data_ptr(), a.qkv_dtype = dtype_of(qkv, "rope_and_cache qkv");
  a.positions = positions.data_ptr<int64_t>(), a.cos = cos.data_ptr<float>(), a.sin = sin.data_ptr<float>();
  a.k_cache = k_cache.data_ptr(), a.v_cache = v_cache.data_ptr(), a.kv_quant = kv_quant_of(k_cache);
  a.cache_dtype = a.kv_quant == pagemill::KvQuant::NONE ? dtype_of(k_cache, "rope_and_cache cache") : DType::F32;
  TORCH_CHECK(a.n_cached == 0 || k_cache.size(3) == pagemill::kv_row_width(a.kv_quant, a.D),
              "rope_and_cache: cache rows must be ", pagemill::kv_row_width(a.kv_quant, a.D), " wide");
  a.slot_mapping = slot_mapping.data_ptr<int64_t>(), a.num_threads = threads();
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "rope_and_cache: q_norm and k_norm go together");
  a.q_norm = a.k_norm = nullptr, a.norm_eps = static_cast<float>(norm_eps);
  if (q_norm.has_value()) {
    for (const auto* w : {&*q_norm, &*k_norm})
      TORCH_CHECK(w->is_contiguous() && w->scalar_type() == at::kFloat && w->numel() == a.D,
                  "rope_and_cache: q_norm / k_norm must be contiguous float32 [D]");
    a.q_norm = q_norm->data_ptr<float>(), a.k_norm = k_norm->data_ptr<float>();
  }
  active->rope_and_cache(a);
}

namespace {

// The GEMV call's x as fp32 rows (a view when it already is) and its checked arguments.
pagemill::GemvArgs gemv_args(const char* fn, torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& xf,
                             int64_t K, int64_t tiles, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == K, fn, ": x must be contiguous [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf, fn, ": x must be float32 or float16");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == x.size(0), fn, ": out must be contiguous [M, N]");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kHalf, fn, ": out must be float32 or float16");
  TORCH_CHECK(out.size(1) <= tiles * kGemvTile, fn, ": out has more columns than the packed weight");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == out.size(1)),
              fn, ": bias must be contiguous float32 [N]");
  pagemill::GemvArgs a;
  a.out = out.data_ptr(), a.out_dtype = dtype_of(out, fn), a.x = xf.data_ptr<float>();
  a.bias = bias ? bias->data_ptr<float>() : nullptr;
  a.M = x.size(0), a.K = K, a.N = out.size(1), a.tiles = tiles, a.num_threads = threads();
  return a;
}

torch::Tensor as_f32(const torch::Tensor& x) { return x.scalar_type() == at::kFloat ? x : x.to(at::kFloat).contiguous(); }

}  // namespace

namespace {

// gemv_f16 / gemv_bf16: out = x W^T + bias over 16-bit tiles [ceil(N / 64), K, 64] of `dtype`.
void gemv_16bit(const char* fn, at::ScalarType dtype, torch::Tensor& out, const torch::Tensor& x,
                const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias, bool direct_only) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kGemvTile && packed.scalar_type() == dtype &&
                  packed.is_contiguous(), fn, ": packed must be contiguous ", dtype, " tiles [ceil(N / 64), K, 64]");
  const auto xf = as_f32(x);
  auto a = gemv_args(fn, out, x, xf, packed.size(1), packed.size(0), bias);
  if (a.M == 0 || a.N == 0) return;
  a.direct_only = direct_only;
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  (dtype == at::kHalf ? active->gemv_f16 : active->gemv_bf16)(a, w);
}

}  // namespace

void gemv_f16(torch::Tensor out, torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
              bool direct_only) {
  gemv_16bit("gemv_f16", at::kHalf, out, x, packed, bias, direct_only);
}

void gemv_bf16(torch::Tensor out, torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
               bool direct_only) {
  gemv_16bit("gemv_bf16", at::kBFloat16, out, x, packed, bias, direct_only);
}

void gemv_f32(torch::Tensor out, torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kGemvTile && packed.scalar_type() == at::kFloat &&
                  packed.is_contiguous(), "gemv_f32: packed must be float32 [ceil(N/64), K, 64]");
  const auto xf = as_f32(x);
  const auto a = gemv_args("gemv_f32", out, x, xf, packed.size(1), packed.size(0), bias);
  if (a.M == 0 || a.N == 0) return;
  active->gemv_f32(a, packed.data_ptr<float>());
}

void gemv_int8(torch::Tensor out, torch::Tensor x, torch::Tensor packed_q, torch::Tensor scales,
               c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> mins, bool direct_only,
               bool int8_activations) {
  TORCH_CHECK(packed_q.dim() == 3 && packed_q.size(2) == kGemvTile && packed_q.scalar_type() == at::kChar &&
                  packed_q.is_contiguous(), "gemv_int8: packed_q must come from pack_gemv_weight_int8");
  const int64_t tiles = packed_q.size(0), Kp = packed_q.size(1), K = x.size(1);
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == tiles && scales.size(2) == kGemvTile && scales.size(1) > 0 &&
                  Kp % scales.size(1) == 0 && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "gemv_int8: scales must come from pack_gemv_weight_int8");
  const int64_t G = Kp / scales.size(1);
  TORCH_CHECK(K <= Kp && Kp - K < G, "gemv_int8: x has ", K, " columns, the packed weight ", Kp, " (padded)");
  // The kernels add a group's min term once per k range, so every range must be one whole group (G | 256).
  TORCH_CHECK(!mins || (mins->sizes() == scales.sizes() && mins->scalar_type() == at::kFloat &&
                        mins->is_contiguous() && 256 % G == 0),
              "gemv_int8: mins must be contiguous float32 shaped like scales, with a group size dividing 256");
  const auto xf = as_f32(x);
  auto a = gemv_args("gemv_int8", out, x, xf, K, tiles, bias);
  a.direct_only = direct_only, a.int8_activations = int8_activations;
  if (a.M == 0 || a.N == 0) return;
  active->gemv_int8(a, packed_q.data_ptr<int8_t>(), scales.data_ptr<float>(), mins ? mins->data_ptr<float>() : nullptr,
                    Kp, G);
}

using pagemill::RecordFormat;

RecordFormat pagemill::record_format(const std::string& name) {
  if (name == "q4_1") return RecordFormat::Q4_1;
  if (name == "q5_1") return RecordFormat::Q5_1;
  if (name == "q4_k") return RecordFormat::Q4_K;
  if (name == "q5_k") return RecordFormat::Q5_K;
  if (name == "q6_k") return RecordFormat::Q6_K;
  if (name == "q2_k") return RecordFormat::Q2_K;
  TORCH_CHECK(name == "q3_k", "gemv_records: unknown record format '", name,
              "' (q4_1, q5_1, q4_k, q5_k, q6_k, q2_k, q3_k)");
  return RecordFormat::Q3_K;
}

int64_t pagemill::record_bytes(RecordFormat f) {
  constexpr int64_t T = kGemvTile;
  switch (f) {
    case RecordFormat::Q4_1: return 16 * T + 4 * T;
    case RecordFormat::Q5_1: return 16 * T + 4 * T + 4 * T;
    case RecordFormat::Q4_K: return 8 * (16 * T) + 4 * T + 16 * T;
    case RecordFormat::Q5_K: return 8 * (16 * T + 4 * T) + 4 * T + 16 * T;
    case RecordFormat::Q6_K: return 16 * (8 * T + 4 * T) + 2 * T + 16 * T;
    case RecordFormat::Q2_K: return 16 * (8 * T) + 4 * T + 32 * T;
    case RecordFormat::Q3_K: return 16 * (8 * T) + 2 * T + 16 * T;
  }
  return 0;
}

int64_t pagemill::record_length(RecordFormat f) {
  return f == RecordFormat::Q4_1 || f == RecordFormat::Q5_1 ? 32 : 256;
}

using pagemill::record_bytes;
using pagemill::record_format;
using pagemill::record_length;

void gemv_records(torch::Tensor out, torch::Tensor x, torch::Tensor packed, const std::string& format,
                  c10::optional<torch::Tensor> bias, bool direct_only, bool int8_activations) {
  const RecordFormat f = record_format(format);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == record_bytes(f), "gemv_records: packed must hold ", format, " records [T, K / ",
              record_length(f), ", ", record_bytes(f), "]");
  const auto xf = as_f32(x);
  auto a = gemv_args("gemv_records", out, x, xf, packed.size(1) * record_length(f), packed.size(0), bias);
  a.direct_only = direct_only, a.int8_activations = int8_activations;
  if (a.M == 0 || a.N == 0) return;
  active->gemv_records(a, packed.data_ptr<uint8_t>(), f);
}

void gemv_q4(torch::Tensor out, torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  constexpr int64_t dm_bytes = 4 * kGemvTile;
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) > dm_bytes && (packed.size(2) - dm_bytes) % kGemvTile == 0,
              "gemv_q4: packed must come from pack_gemv_weight_q4");
  const int64_t G = (packed.size(2) - dm_bytes) / kGemvTile * 2;
  const auto xf = as_f32(x);
  const auto a = gemv_args("gemv_q4", out, x, xf, packed.size(1) * G, packed.size(0), bias);
  if (a.M == 0 || a.N == 0) return;
  active->gemv_q4(a, packed.data_ptr<uint8_t>(), G);
}

// A GGUF block-quantized matrix given as its blocks, uint8 [N, K / block length, block bytes] or [N, row bytes] (rows
// may be strided, e.g. a view of the file map), checked against K.
pagemill::GGUFRows gguf_rows_of(const char* who, const torch::Tensor& blocks, int64_t ggml_type, int64_t K) {
  int64_t length = 0, bytes = 0;
  TORCH_CHECK(pagemill::gguf_row_format(static_cast<int>(ggml_type), &length, &bytes), who,
              ": ggml type ", ggml_type, " is not a block format decoded here (Q4_0 .. Q8_0, Q2_K .. Q6_K)");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && (blocks.dim() == 2 || blocks.dim() == 3), who,
              ": the GGUF blocks must be uint8 [N, blocks, bytes] or [N, row bytes]");
  const int64_t row_bytes = blocks.numel() / std::max<int64_t>(1, blocks.size(0));
  TORCH_CHECK(K % length == 0 && row_bytes == K / length * bytes, who, ": rows of ", row_bytes, " bytes do not hold ",
              K, " ggml type ", ggml_type, " weights");
  const bool rows_contiguous = blocks.dim() == 2 ? blocks.stride(1) == 1
                                                 : blocks.stride(2) == 1 && blocks.stride(1) == bytes;
  TORCH_CHECK(rows_contiguous, who, ": each row's blocks must be contiguous");
  return pagemill::GGUFRows{blocks.data_ptr<uint8_t>(), blocks.stride(0), K, static_cast<int>(ggml_type)};
}

// out [n, K] = rows ids of a GGUF block-quantized matrix as float32, bit for bit gguf.quants' values (gguf_rows.cpp).
void gguf_rows(torch::Tensor out, torch::Tensor blocks, int64_t ggml_type, torch::Tensor ids) {
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "gguf_rows: out must be a contiguous float32 [n, K] tensor");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.size(0) == out.size(0),
              "gguf_rows: ids must be a contiguous int64 [n] tensor, one per row of out");
  const auto src = gguf_rows_of("gguf_rows", blocks, ggml_type, out.size(1));
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t n = ids.size(0), N = blocks.size(0);
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < N, "gguf_rows: id ", id[i], " out of range [0, ", N, ")");
  at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
    pagemill::gguf_dequantize_rows(src, id + i0, i1 - i0, out.data_ptr<float>() + i0 * out.size(1));
  });
}

// logits [M, N] fp32 for greedy rows: int8 screen, exact float32 wherever a row's maximum may be (variant/head_screen.cpp).
int64_t head_screen(torch::Tensor logits, torch::Tensor x, torch::Tensor q, torch::Tensor scales, torch::Tensor offsets,
                    torch::Tensor table, torch::Tensor bounds,
                    c10::optional<torch::Tensor> argmax, c10::optional<torch::Tensor> bitmask,
                    c10::optional<torch::Tensor> mask_rows, int64_t table_ggml_type) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "head_screen: x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 32 == 0, "head_screen: K must be a multiple of 32");
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kChar && q.is_contiguous() && q.size(1) * 4 == K &&
                  q.size(2) == kGemvTile && q.size(3) == 4, "head_screen: q must come from pack_head_screen");
  const int64_t tiles = q.size(0);
  for (const auto* t : {&scales, &offsets})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == tiles && t->size(1) * 32 == K && t->size(2) == kGemvTile &&
                    t->is_contiguous(), "head_screen: scales / offsets must come from pack_head_screen");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && offsets.scalar_type() == at::kInt, "head_screen: scales float32, offsets int32");
  TORCH_CHECK(bounds.dim() == 3 && bounds.size(0) == tiles && bounds.size(1) == 2 && bounds.size(2) == kGemvTile &&
                  bounds.is_contiguous() && bounds.scalar_type() == at::kFloat,
              "head_screen: bounds must be the float32 [T, 2, 64] of pack_head_screen");
  pagemill::GGUFRows rows_src{};
  if (table_ggml_type == 0) {
    TORCH_CHECK(table.dim() == 2 && table.is_contiguous() && table.scalar_type() == at::kFloat && table.size(1) == K,
                "head_screen: table must be the contiguous float32 [N, K] weight");
  } else {
    rows_src = gguf_rows_of("head_screen", table, table_ggml_type, K);
  }
  TORCH_CHECK(table.size(0) <= tiles * kGemvTile && table.size(0) > (tiles - 1) * kGemvTile,
              "head_screen: table has ", table.size(0), " rows, the screen ", tiles, " tiles of ", kGemvTile);
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat &&
                  logits.size(0) == M && logits.size(1) == table.size(0), "head_screen: logits must be contiguous float32 [M, N]");
  pagemill::HeadScreenArgs a;
  a.logits = logits.data_ptr<float>(), a.x = x.data_ptr<float>(), a.q = q.data_ptr<int8_t>();
  a.scales = scales.data_ptr<float>(), a.offsets = offsets.data_ptr<int32_t>();
  if (table_ggml_type == 0) {
    a.table = table.data_ptr<float>();
  } else {
    a.table = nullptr, a.table_rows = &pagemill::gguf_dequantize_rows_cb, a.table_rows_src = &rows_src;
  }
  a.bounds = bounds.data_ptr<float>();
  TORCH_CHECK(!argmax || (argmax->scalar_type() == at::kLong && argmax->is_contiguous() && argmax->numel() == M),
              "head_screen: argmax must be a contiguous int64 [M]");
  a.argmax = argmax ? argmax->data_ptr<int64_t>() : nullptr;
  TORCH_CHECK(bitmask.has_value() == mask_rows.has_value(), "head_screen: bitmask and mask_rows go together");
  if (bitmask) {
    TORCH_CHECK(bitmask->dim() == 2 && bitmask->scalar_type() == at::kInt && bitmask->is_contiguous(),
                "head_screen: bitmask must be a contiguous int32 [R, W] tensor");
    TORCH_CHECK(mask_rows->dim() == 1 && mask_rows->scalar_type() == at::kLong && mask_rows->is_contiguous() &&
                    mask_rows->size(0) == M, "head_screen: mask_rows must be a contiguous int64 [M]");
    const int64_t* mr = mask_rows->data_ptr<int64_t>();
    for (int64_t i = 0; i < M; ++i)
      TORCH_CHECK(mr[i] >= -1 && mr[i] < bitmask->size(0), "head_screen: mask_rows out of range");
    a.bitmask = bitmask->data_ptr<int32_t>(), a.mask_rows = mr, a.mask_words = bitmask->size(1);
  }
  a.M = M, a.K = K, a.N = table.size(0), a.tiles = tiles, a.num_threads = threads();
  if (M == 0) return 0;
  return active->head_screen(a);
}

void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "apply_token_bitmask: logits must be a contiguous float32 [S, V] tensor");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "apply_token_bitmask: bitmask must be a contiguous int32 [R, W] tensor");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous() &&
                  rows.size(0) == bitmask.size(0), "apply_token_bitmask: rows must be int64 [R]");
  const int64_t S = logits.size(0), R = rows.size(0);
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i) TORCH_CHECK(r[i] >= 0 && r[i] < S, "apply_token_bitmask: row out of range");
  active->apply_token_bitmask(logits.data_ptr<float>(), logits.size(1), bitmask.data_ptr<int32_t>(), bitmask.size(1),
                              r, R, threads());
}

// y [T, N] += (x[a:b] @ lora_a[s]) @ lora_b[s] for each row (a, b, s) of runs, in place (variant/lora.cpp).
void lora_delta(torch::Tensor y, torch::Tensor x, torch::Tensor lora_a, torch::Tensor lora_b, torch::Tensor runs) {
  auto check = [](const torch::Tensor& t, const char* name, int64_t dims) {
    TORCH_CHECK(t.dim() == dims && t.scalar_type() == at::kFloat && t.is_contiguous(), "lora_delta: ", name,
                " must be a contiguous float32 tensor of ", dims, " dimensions");
  };
  check(y, "y", 2), check(x, "x", 2), check(lora_a, "lora_a", 3), check(lora_b, "lora_b", 3);
  const int64_t T = y.size(0), N = y.size(1), K = x.size(1), S = lora_a.size(0), Wd = lora_a.size(2);
  TORCH_CHECK(x.size(0) == T, "lora_delta: x has ", x.size(0), " rows, y ", T);
  TORCH_CHECK(lora_a.size(1) == K, "lora_delta: lora_a must be [slots, ", K, ", width] for x of ", K, " columns");
  TORCH_CHECK(lora_b.size(0) == S && lora_b.size(1) == Wd && lora_b.size(2) == N, "lora_delta: lora_b must be [",
              S, ", ", Wd, ", ", N, "] (lora_a's slots and width, y's columns)");
  TORCH_CHECK(runs.dim() == 2 && runs.size(1) == 3 && runs.scalar_type() == at::kInt && runs.is_contiguous(),
              "lora_delta: runs must be a contiguous int32 [R, 3] tensor of (start, end, slot)");
  const int32_t* r = runs.data_ptr<int32_t>();
  int64_t prev_end = 0;
  for (int64_t i = 0; i < runs.size(0); ++i) {
    TORCH_CHECK(r[3 * i] >= prev_end && r[3 * i + 1] >= r[3 * i] && r[3 * i + 1] <= T, "lora_delta: runs[", i,
                "] = (", r[3 * i], ", ", r[3 * i + 1], ") must be sorted, disjoint and within the ", T, " rows");
    TORCH_CHECK(r[3 * i + 2] >= 0 && r[3 * i + 2] < S, "lora_delta: runs[", i, "] uses slot ", r[3 * i + 2],
                " of ", S);
    prev_end = r[3 * i + 1];
  }
  pagemill::LoraArgs a;
  a.y = y.data_ptr<float>(), a.x = x.data_ptr<float>(), a.lora_a = lora_a.data_ptr<float>();
  a.lora_b = lora_b.data_ptr<float>(), a.runs = r;
  a.T = T, a.K = K, a.N = N, a.width = Wd, a.num_runs = runs.size(0), a.num_threads = threads();
  active->lora_delta(a);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa, "The active kernel variant");
  m.def("set_isa", &set_isa, "Switch the active kernel variant (one this CPU supports)", py::arg("name"));
  m.def("split_zmm_units", &pagemill::split_zmm_units,
        "Whether the one-row float kernels use the split-512-bit-unit weight unpack (detected: AMD Zen 4)");
  m.def("set_split_zmm_units", &set_split_zmm_units, "Override split_zmm_units (tests, benchmarks)", py::arg("on"));
  m.def("compiled_isas", &compiled_isas, "Kernel variants built into this module, best first");
  m.def("supported_isas", &supported_isas, "Compiled kernel variants this CPU can run, best first");
  m.def("paged_attention", &paged_attention, "Paged attention over the KV cache blocks");
  m.def("rms_norm", &rms_norm, "out = RMSNorm(x) * weight");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; out = RMSNorm(residual) * weight");
  m.def("silu_and_mul", &silu_and_mul, "out = silu(x[:, :I]) * x[:, I:]");
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "out = gelu_tanh(x[:, :I]) * x[:, I:]");
  m.def("rope_and_cache", &rope_and_cache, "RoPE on q/k (after an optional per-head QK RMSNorm) from a fused qkv "
        "row, K/V written to the cache slots", py::arg("q_out"), py::arg("k_out"), py::arg("v_out"), py::arg("qkv"),
        py::arg("positions"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("slot_mapping"), py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(),
        py::arg("norm_eps") = 1e-6);
  m.def("pack_gemv_weight_f16", &pack_gemv_weight_f16, "Pack a [N, K] weight for gemv_f16: [ceil(N/64), K, 64] fp16");
  m.def("gemv_f16", &gemv_f16, "out = x @ W^T + bias over fp16 tiles [ceil(N/64), K, 64] (pack_gemv_weight_f16), "
        "widened to fp32: few rows streamed, more through fp32 panels unless direct_only (fixed order per row)",
        py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(), py::arg("direct_only") = false);
  m.def("gemv_bf16", &gemv_bf16, "gemv_f16 over bf16 tiles [ceil(N/64), K, 64]", py::arg("out"), py::arg("x"),
        py::arg("packed"), py::arg("bias") = py::none(), py::arg("direct_only") = false);
  m.def("gemv_f32", &gemv_f32, "out = x @ W^T + bias in a fixed reduction order (a row's result does not depend on "
        "the other rows), W float32 packed [ceil(N/64), K, 64]", py::arg("out"), py::arg("x"), py::arg("packed"),
        py::arg("bias") = py::none());
  m.def("pack_gemv_weight_int8", &pack_gemv_weight_int8,
        "Quantize + pack a [N, K] weight for gemv_int8: [q int8 [T, Kp, 64], scales fp32 [T, Kp/G, 64]]",
        py::arg("w"), py::arg("group_size"));
  m.def("gemv_int8", &gemv_int8, "out = x @ W^T + bias (few rows streamed; more through fp32 panels), W from pack_gemv_weight_int8",
        py::arg("out"), py::arg("x"), py::arg("packed_q"), py::arg("scales"), py::arg("bias") = py::none(),
        py::arg("mins") = py::none(), py::arg("direct_only") = false, py::arg("int8_activations") = false);
  m.def("pack_gemv_weight_q4", &pack_gemv_weight_q4,
        "Recover Q4_1 (w = d*q + m per group) from a dequantized [N, K] weight and pack it for gemv_q4: "
        "[packed uint8 [T, K/G, G/2*64 + 256], max |d*q + m - w| / max |w| (float64 scalar)]",
        py::arg("w"), py::arg("group_size"));
  m.def("q4_max_error", &q4_max_error, "max |d*q + m - w| / max |w| of the Q4_1 fit of pack_gemv_weight_q4",
        py::arg("w"), py::arg("group_size"));
  m.def("pack_head_screen", &pack_head_screen,
        "int8 screen of an LM head [N, K] (per channel and group of 32): (q [T, K/4, 64, 4], scales, offsets [T, K/32, 64], "
        "bounds [T, 2, 64]: each channel's |w - w~| and |w~|)", py::arg("w"));
  m.def("head_screen", &head_screen, "Greedy-exact LM head logits: int8 screen plus exact float32 recheck (a row with "
        "a bitmask row, mask_rows[r] >= 0: over its allowed tokens only); returns the number of logits recomputed", py::arg("logits"), py::arg("x"), py::arg("q"), py::arg("scales"),
        py::arg("offsets"), py::arg("table"), py::arg("bounds"),
        py::arg("argmax") = py::none(), py::arg("bitmask") = py::none(), py::arg("mask_rows") = py::none(),
        py::arg("table_ggml_type") = 0);
  m.def("gguf_rows", &gguf_rows, "out[i] = row ids[i] of a GGUF block-quantized matrix (its blocks, uint8 [N, nb, "
        "bytes]) as float32, gguf.quants' values bit for bit", py::arg("out"), py::arg("blocks"), py::arg("ggml_type"),
        py::arg("ids"));
  m.def("gemv_records", &gemv_records,
        "out = x @ W^T + bias over GGUF bit-plane records (q4_1, q5_1, q4_k, q5_k, q6_k, q2_k, q3_k; layouts: "
        "csrc/cpu/variant/gemv.cpp, made by pagemill.layers.quantization.gguf_records)",
        py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("format"), py::arg("bias") = py::none(),
        py::arg("direct_only") = false, py::arg("int8_activations") = false);
  m.def("gemv_q4", &gemv_q4, "out = x @ W^T + bias (few rows streamed; more through fp32 panels), W packed by pack_gemv_weight_q4",
        py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("bias") = py::none());
  m.def("apply_token_bitmask", &apply_token_bitmask,
        "Structured output: logits[rows[r], t] = -inf where bit t of bitmask[r] (int32 words) is 0; in place",
        py::arg("logits"), py::arg("bitmask"), py::arg("rows"));
  m.def("lora_delta", &lora_delta,
        "Multi-LoRA: y[a:b] += (x[a:b] @ lora_a[s]) @ lora_b[s] for each (a, b, s) of runs, in place; float32",
        py::arg("y"), py::arg("x"), py::arg("lora_a"), py::arg("lora_b"), py::arg("runs"));
  pagemill::register_decoder_graph(m);
}
