// The decoder stack of a small step in one call (decoder_graph.cpp).
#pragma once
#include <torch/extension.h>

namespace pagemill {

void register_decoder_graph(pybind11::module& m);

}  // namespace pagemill
