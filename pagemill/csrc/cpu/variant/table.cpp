// This variant's kernel table: the one symbol the bindings call it by (kernel_table_<variant>).
#include "simd.h"

#define PAGEMILL_CAT2(a, b) a##b
#define PAGEMILL_CAT(a, b) PAGEMILL_CAT2(a, b)
#define PAGEMILL_STR2(a) #a
#define PAGEMILL_STR(a) PAGEMILL_STR2(a)

namespace pagemill {
namespace PAGEMILL_ISA {

void paged_attention(const PagedAttentionArgs& a);
void rms_norm(void* out, DType out_dtype, const void* x, DType x_dtype, const float* w, int64_t T, int64_t H,
              float eps, int num_threads);
void fused_add_rms_norm(void* out, DType out_dtype, const void* x, DType x_dtype, float* residual, const float* w,
                        int64_t T, int64_t H, float eps, int num_threads);
void silu_and_mul(void* out, DType out_dtype, const void* x, DType x_dtype, int64_t T, int64_t I, int num_threads);
void rope_and_cache(const RopeCacheArgs& a);
void gelu_tanh_and_mul(void* out, DType out_dtype, const void* x, DType x_dtype, int64_t T, int64_t I,
                       int num_threads);
void gemv_f16(const GemvArgs& a, const uint16_t* packed);
void gemv_bf16(const GemvArgs& a, const uint16_t* packed);
void gemv_int8(const GemvArgs& a, const int8_t* q, const float* scales, const float* mins, int64_t Kp, int64_t G);
void gemv_q4(const GemvArgs& a, const uint8_t* packed, int64_t G);
void gemv_records(const GemvArgs& a, const uint8_t* packed, RecordFormat format);
void gemv_f32(const GemvArgs& a, const float* packed);
void lora_delta(const LoraArgs& a);
int64_t head_screen(const HeadScreenArgs& a);
void apply_token_bitmask(float* logits, int64_t V, const int32_t* bitmask, int64_t W, const int64_t* rows, int64_t R,
                         int num_threads);

}  // namespace PAGEMILL_ISA

const KernelTable* PAGEMILL_CAT(kernel_table_, PAGEMILL_ISA)() {
  static const KernelTable table = {
      PAGEMILL_STR(PAGEMILL_ISA),        PAGEMILL_ISA::paged_attention, PAGEMILL_ISA::rms_norm,
      PAGEMILL_ISA::fused_add_rms_norm,  PAGEMILL_ISA::silu_and_mul,    PAGEMILL_ISA::rope_and_cache,
      PAGEMILL_ISA::gemv_f16,            PAGEMILL_ISA::gemv_int8,       PAGEMILL_ISA::gemv_q4,
      PAGEMILL_ISA::gemv_records,       PAGEMILL_ISA::head_screen,     PAGEMILL_ISA::apply_token_bitmask,
      PAGEMILL_ISA::gemv_f32,            PAGEMILL_ISA::gelu_tanh_and_mul,  PAGEMILL_ISA::lora_delta,         PAGEMILL_ISA::gemv_bf16,
  };
  return &table;
}

}  // namespace pagemill
