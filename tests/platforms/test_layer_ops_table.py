"""The per-device layer-ops table: the platform names the tables each attention backend gets (by import path),
`select_layer_ops` builds the first available one, the runners use it, and layers reach the compiled CPU kernels
only through it: the quantization methods, the quantized embedding, the head screen and the sampler call the table's
linear ops (`LINEAR_KERNELS`), which the compiled table binds to the module's functions themselves."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from pagemill.kernels import load_kernels
from pagemill.kernels.ops import LINEAR_KERNELS, KernelLayerOps, TorchLayerOps, select_layer_ops
from pagemill.platforms.cpu import KERNEL_OPS, TORCH_OPS, CpuPlatform
from pagemill.platforms.cuda import TRITON_OPS, CudaPlatform
from pagemill.utils.import_utils import resolve_obj_by_qualname

PACKAGE = Path(__file__).resolve().parents[2] / "pagemill"


@pytest.mark.parametrize("platform", [CpuPlatform, CudaPlatform])
def test_every_named_table_is_a_layer_ops_class(platform):
    assert "*" in platform.layer_ops
    for paths in platform.layer_ops.values():
        assert paths
        for path in paths:
            cls = resolve_obj_by_qualname(path)
            assert issubclass(cls, TorchLayerOps) and callable(cls.create)


def test_cpu_platform_choice():
    assert CpuPlatform.get_layer_ops_cls("torch") == (TORCH_OPS,)
    assert CpuPlatform.get_layer_ops_cls("cpu") == (KERNEL_OPS, TORCH_OPS)
    assert CpuPlatform.get_layer_ops_cls("virtual") == (KERNEL_OPS, TORCH_OPS)  # any other backend: "*"
    assert type(select_layer_ops("torch")) is TorchLayerOps
    built = load_kernels() is not None
    ops = select_layer_ops("cpu")
    assert type(ops) is (KernelLayerOps if built else TorchLayerOps)  # torch fallback when the kernels are missing
    assert (ops.kernels is not None) == built and not ops.fused_rotary


def test_cuda_platform_choice_without_a_gpu():
    """The CUDA table is read from the class (no device needed): Triton ops with Triton attention, never the CPU's
    compiled kernels."""
    assert CudaPlatform.get_layer_ops_cls("triton") == (TRITON_OPS, TORCH_OPS)
    assert type(select_layer_ops("torch", CudaPlatform)) is TorchLayerOps
    assert type(select_layer_ops("cpu", CudaPlatform)) is TorchLayerOps
    ops = select_layer_ops("triton", CudaPlatform)
    try:
        import triton  # noqa: F401
    except ImportError:
        assert type(ops) is TorchLayerOps
    else:
        assert type(ops).__name__ == "TritonLayerOps" and ops.fused_rotary


def test_tables_compute_the_same_norm():
    """Whatever the platform picks computes the reference's RMSNorm (the tables are interchangeable)."""
    x, w = torch.randn(5, 64), torch.rand(64) + 0.5
    ref = TorchLayerOps().rms_norm(x, w, 1e-6, torch.float32)
    torch.testing.assert_close(select_layer_ops("cpu").rms_norm(x, w, 1e-6, torch.float32), ref, rtol=1e-5, atol=1e-5)


def test_layers_reach_compiled_kernels_only_through_the_table():
    """No module of layers/, models/, loader/ or lora/ loads the compiled module itself: it gets `ops.kernels`."""
    offenders = []
    for folder in ("layers", "models", "loader", "lora"):
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [f"{node.module}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                if any(n.startswith("pagemill.kernels.build") or n.endswith(".load_kernels") or "_C" in n.split(".")
                       for n in names):
                    offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not offenders, offenders



def test_no_layer_reaches_into_the_tables_module():
    """Outside kernels/ (and the CPU attention backend, which is the compiled kernel itself), nothing reads an
    `x.kernels` attribute: every compiled op is a method of the layer-ops table."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("kernels/") or rel == "attention/backends/cpu_paged.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "kernels":
                offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, offenders


@pytest.mark.parametrize("op", LINEAR_KERNELS)
def test_torch_table_has_no_linear_kernels(op):
    """The reference table says so (linear_kernels, has_kernel) and a call raises a ValueError naming the op."""
    ops = TorchLayerOps()
    assert not ops.linear_kernels and not ops.has_kernel(op) and ops.isa() == ""
    with pytest.raises(ValueError, match=op):
        fn = getattr(ops, op)
        fn(*[None] * len(inspect.signature(fn).parameters))


def test_kernel_table_binds_the_module_functions():
    """A call through the compiled table is the pybind call itself: no Python frame in between (the decode path)."""
    kernels = load_kernels()
    if kernels is None:
        pytest.skip("the compiled kernels are not built here")
    ops = KernelLayerOps(kernels)
    assert ops.linear_kernels and ops.isa is kernels.isa and ops.isa() == kernels.isa()
    for op in LINEAR_KERNELS:
        assert ops.has_kernel(op) and getattr(ops, op) is getattr(kernels, op)


def test_quant_methods_need_the_compiled_table():
    """int4 / int8 / GPTQ-style methods run compiled kernels: the torch table gets a ValueError naming the option."""
    from pagemill.layers.quantization import get_quant_config

    for quantization in ("int4", "int8"):
        with pytest.raises(ValueError, match=f"quantization='{quantization}'"):
            get_quant_config("auto", quantization, torch.float32, TorchLayerOps())
