"""Per-call overhead of reaching the compiled kernels through the layer-ops table (issue 35).

1. 10^5 one-row q4-records GEMV calls (64 x 32: the call dominates), interleaved rounds, best of 9: the pybind
   function called on the module, through `KernelLayerOps` (which binds that same function), and through a Python
   method that forwards (what a table method with its own frame would cost).
2. With `--torch-ops`: one no-op C++ function bound both through pybind11 and as a `TORCH_LIBRARY` op
   (`torch.ops.pm_bench.noop`, vLLM's `torch.ops._C` pattern), compiled here with torch's cpp_extension.

Run: OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/kernels/ops_table_overhead.py [--torch-ops]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from pagemill.kernels import load_kernels
from pagemill.kernels.ops import KernelLayerOps
from pagemill.layers.quantization.gguf_records import PLANE_LAYOUTS

N = 100_000
ROUNDS = 9


class ForwardingOps:
    """A table whose method forwards to the module (one extra Python frame per call)."""

    def __init__(self, kernels: Any) -> None:
        self.kernels = kernels

    def gemv_records(self, out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, format: str,
                     bias: torch.Tensor | None = None, direct_only: bool = False,
                     int8_activations: bool = False) -> None:
        """Forward to the module's function."""
        self.kernels.gemv_records(out, x, packed, format, bias, direct_only=direct_only,
                                  int8_activations=int8_activations)


def best_us(calls: dict[str, Callable[[], None]]) -> dict[str, float]:
    """Best microseconds per call of each loop over ROUNDS interleaved rounds."""
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(ROUNDS):
        for name, loop in calls.items():
            start = time.perf_counter()
            loop()
            best[name] = min(best[name], (time.perf_counter() - start) / N * 1e6)
    return {name: round(us, 3) for name, us in best.items()}


def gemv_overhead() -> dict[str, float]:
    """Direct module call vs the ops table vs a forwarding method, one-row GEMV."""
    kernels = load_kernels()
    if kernels is None:
        raise SystemExit("the compiled kernels are not built (python -m pagemill.kernels.build)")
    ops, fwd = KernelLayerOps(kernels), ForwardingOps(kernels)
    packed, _ = kernels.pack_gemv_weight_q4(torch.randn(64, 32), 32)
    fmt, x, out = PLANE_LAYOUTS["q4"][3], torch.randn(1, 32), torch.empty(1, 64)

    def loop(target: Any) -> Callable[[], None]:
        def run() -> None:
            for _ in range(N):
                target.gemv_records(out, x, packed, fmt, None, direct_only=False, int8_activations=False)
        return run

    return best_us({"direct module": loop(kernels), "ops table": loop(ops), "forwarding method": loop(fwd)})


_NOOP = r"""
#include <torch/extension.h>
void noop(torch::Tensor out, torch::Tensor x, const c10::optional<torch::Tensor>& bias, bool direct_only) {}
TORCH_LIBRARY(pm_bench, m) { m.def("noop(Tensor(a!) out, Tensor x, Tensor? bias, bool direct_only) -> ()"); }
TORCH_LIBRARY_IMPL(pm_bench, CPU, m) { m.impl("noop", &noop); }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("noop", &noop, py::arg("out"), py::arg("x"), py::arg("bias"), py::arg("direct_only") = false);
}
"""


def torch_ops_overhead() -> dict[str, float]:
    """The same no-op C++ function through pybind11 and through torch.ops."""
    from torch.utils.cpp_extension import load_inline

    module = load_inline("pm_opbench", cpp_sources=[_NOOP], build_directory=tempfile.mkdtemp(), extra_cflags=["-O2"])
    op, out, x = torch.ops.pm_bench.noop, torch.empty(1, 576), torch.randn(1, 576)

    def loop(fn: Callable[..., None]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(N):
                fn(out, x, None, False)
        return run

    return best_us({"pybind": loop(module.noop), "torch.ops": loop(op)})


def main() -> None:
    """Print microseconds per call, best of ROUNDS interleaved rounds of N calls."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--torch-ops", action="store_true", help="also compile and time a TORCH_LIBRARY no-op")
    args = parser.parse_args()
    print("one-row GEMV, us per call:", gemv_overhead())
    if args.torch_ops:
        print("no-op, us per call:", torch_ops_overhead())


if __name__ == "__main__":
    main()
