// What the torch-facing sources (bindings.cpp, decoder_graph.cpp) share: the active kernel variant and the checks
// that map tensors to the kernels' plain C arguments (defined in bindings.cpp).
#pragma once
#include <torch/extension.h>

#include <string>

#include "kernels.h"

namespace pagemill {

const KernelTable* active_kernel_table();  // the variant set_isa chose (the best this CPU runs by default)
DType dtype_of(const torch::Tensor& t, const char* what);  // F32 / F16 / BF16, else an error naming `what`
int threads();  // at::get_num_threads()
// A cache of int8 / fp8 codes holds quantized rows (pagemill/attention/kv_quant.py); any other dtype: NONE.
KvQuant kv_quant_of(const torch::Tensor& cache);
RecordFormat record_format(const std::string& name);  // "q4_1", "q4_k", ... (an error names the known ones)
// Bytes of one record (per 64-channel tile) and the weights along K it covers (layouts: variant/gemv.cpp).
int64_t record_bytes(RecordFormat f);
int64_t record_length(RecordFormat f);

}  // namespace pagemill
