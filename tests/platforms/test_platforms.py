"""The platform layer: the CPU platform's facts and choices, the CUDA platform's clear refusal, and the engine paths
that now ask the platform (attention backend, KV-cache sizing, process set-up, distributed backend)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from pagemill.attention.selector import get_attn_backend
from pagemill.engine.arg_utils import EngineArgs
from pagemill.platforms import DEVICE_ENV, current_platform, resolve_current_platform
from pagemill.platforms.cpu import CPU_INVARIANT, CPU_PAGED, TORCH_PAGED, VIRTUAL_CONTIGUOUS, CpuPlatform
from pagemill.platforms.cuda import CudaPlatform
from pagemill.platforms.interface import PlatformEnum
from pagemill.utils.import_utils import resolve_obj_by_qualname


def test_current_platform_is_the_cpu_and_states_its_facts():
    assert isinstance(current_platform, CpuPlatform) and current_platform.is_cpu() and not current_platform.is_cuda()
    assert current_platform.device == torch.device("cpu")
    assert current_platform.default_dtype == torch.float32
    assert current_platform.dist_backend == "gloo"
    assert current_platform.attention_backend_names() == ("auto", "cpu", "torch", "triton")
    assert set(current_platform.supported_quantization) == {"none", "gguf", "int8", "int4", "gptq", "awq",
                                                           "compressed-tensors", "fp8"}
    # every class the platform names by path resolves (the platform imports none of them)
    for qualname in (*current_platform.attention_backends.values(), CPU_INVARIANT, VIRTUAL_CONTIGUOUS,
                     current_platform.worker_cls, current_platform.device_communicator):
        assert callable(resolve_obj_by_qualname(qualname)), qualname


def test_device_selection(monkeypatch):
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    assert isinstance(resolve_current_platform(), CpuPlatform)
    assert isinstance(resolve_current_platform(" CPU "), CpuPlatform)
    assert isinstance(resolve_current_platform(""), CpuPlatform)
    with pytest.raises(ValueError, match=f"{DEVICE_ENV} must be one of auto, cpu, cuda, got 'tpu'"):
        resolve_current_platform("tpu")
    if CudaPlatform.is_available():
        return
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    with pytest.raises(RuntimeError, match="no CUDA device is visible"):
        resolve_current_platform()


def test_cuda_platform_facts_and_refusal_without_a_gpu():
    assert CudaPlatform._enum == PlatformEnum.CUDA
    assert (CudaPlatform.device_type, CudaPlatform.dist_backend, CudaPlatform.default_dtype_name) == \
        ("cuda", "nccl", "bfloat16")
    assert CudaPlatform.worker_cls == "pagemill.worker.gpu_worker.GpuWorker"
    assert CudaPlatform.auto_attention_backends == ("triton",)
    for qualname in (CudaPlatform.worker_cls, CudaPlatform.device_communicator):
        assert callable(resolve_obj_by_qualname(qualname)), qualname
    cuda = object.__new__(CudaPlatform)  # (its facts, without a GPU)
    assert cuda.get_attn_backend_cls("auto", False, "paged") == [CudaPlatform.attention_backends["triton"]]
    # vTensor on CUDA: the ranges are read by the Triton kernel, so the torch reference is refused by name
    assert cuda.get_attn_backend_cls("auto", False, "virtual") == [CudaPlatform.attention_backends["triton"]]
    with pytest.raises(ValueError, match="kv_cache_layout='virtual' on CUDA.*attention_backend='torch'"):
        cuda.get_attn_backend_cls("torch", False, "virtual")
    with pytest.raises(ValueError, match="attention_backend must be one of auto, triton, torch, got 'cpu'"):
        cuda.get_attn_backend_cls("cpu", False, "paged")
    assert cuda.kv_cache_memory_bytes(None, 0.8) == 0  # the worker profiles, then sizes
    assert cuda.kv_cache_memory_bytes("1GiB", None) == 2**30
    if not CudaPlatform.is_available():
        with pytest.raises(RuntimeError, match="PAGEMILL_DEVICE=cuda"):
            CudaPlatform()


def test_attention_backend_choice():
    cpu = current_platform
    assert cpu.get_attn_backend_cls("auto", False, "paged") == [CPU_PAGED, TORCH_PAGED]
    assert cpu.get_attn_backend_cls("torch", False, "paged") == [TORCH_PAGED]
    assert cpu.get_attn_backend_cls("cpu", False, "paged") == [CPU_PAGED]
    assert cpu.get_attn_backend_cls("auto", True, "paged") == [CPU_INVARIANT]
    assert cpu.get_attn_backend_cls("auto", False, "virtual") == [VIRTUAL_CONTIGUOUS]
    with pytest.raises(ValueError, match="attention_backend must be one of auto, cpu, torch, triton, got 'flash'"):
        cpu.get_attn_backend_cls("flash", False, "paged")
    with pytest.raises(ValueError, match="batch_invariant=True needs attention_backend auto or cpu, not torch"):
        cpu.get_attn_backend_cls("torch", True, "paged")
    for explicit in ("cpu", "torch"):  # an explicit backend and the virtual layout: an error, never an override
        with pytest.raises(ValueError, match=f"kv_cache_layout='virtual'.*attention_backend='{explicit}'"):
            cpu.get_attn_backend_cls(explicit, False, "virtual")
    assert get_attn_backend("torch").name == "torch"
    assert get_attn_backend("auto", kv_cache_layout="virtual").name == resolve_obj_by_qualname(VIRTUAL_CONTIGUOUS).name


def test_engine_config_is_checked_by_the_platform(smol_path):
    with pytest.raises(ValueError, match="kv_cache_layout='virtual'.*attention_backend='torch'"):
        EngineArgs(smol_path, kv_cache_layout="virtual", attention_backend="torch").create_engine_config()
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineArgs(smol_path, attention_backend="flash").create_engine_config()
    config = EngineArgs(smol_path, kv_cache_memory="64MiB", max_model_len=256).create_engine_config()
    assert config.cache_config.kv_cache_memory == 64 * 2**20
    assert config.model_config.dtype == current_platform.default_dtype


def test_kv_cache_sizing_and_gpu_memory_utilization_said_once(caplog):
    cpu = CpuPlatform()
    assert cpu.kv_cache_memory_bytes("512MiB", None) == 512 * 2**20
    assert cpu.kv_cache_memory_bytes(1000, None) == 1000
    assert 0 < cpu.kv_cache_memory_bytes(None, None) <= 2 * 2**30
    with caplog.at_level(logging.INFO, logger="pagemill.platforms.cpu"):
        assert cpu.kv_cache_memory_bytes("1GiB", 0.37) == 2**30  # accepted, and without effect
        cpu.kv_cache_memory_bytes("1GiB", 0.37)
    said = [r for r in caplog.records if "gpu_memory_utilization=0.37" in r.getMessage()]
    assert len(said) == 1 and "kv_cache_memory" in said[0].getMessage()


def test_default_kv_cache_counts_the_page_cache_as_available(monkeypatch):
    """The default budget is a quarter of MemAvailable (free + droppable page cache), not of free pages: a machine
    whose page cache holds a large model file has little free memory, and LLM() must still start."""
    from pagemill.platforms import cpu as cpu_module

    meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in open("/proc/meminfo")}
    assert cpu_module.available_memory_bytes() == pytest.approx(meminfo["MemAvailable"], rel=0.05)
    monkeypatch.setattr(cpu_module, "available_memory_bytes", lambda: 2 * 2**30)
    assert CpuPlatform().kv_cache_memory_bytes(None, None) == 2**29
    monkeypatch.setattr(cpu_module, "available_memory_bytes", lambda: 64 * 2**30)
    assert CpuPlatform().kv_cache_memory_bytes(None, None) == 2 * 2**30


def test_process_env_keeps_the_users_settings(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    CpuPlatform().set_up_process_env()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and os.environ["GOMP_SPINCOUNT"] == "7"


def test_thread_set_up():
    before = torch.get_num_threads()
    try:
        assert current_platform.init_threads(1) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert current_platform.rank_cores(2, "0-1|2,3") == [[0, 1], [2, 3]]
    assert current_platform.pin_to_cores(None) is None


def test_resolve_obj_by_qualname():
    assert resolve_obj_by_qualname("pagemill.platforms.cpu.CpuPlatform") is CpuPlatform
    with pytest.raises(ValueError, match="not a qualified name"):
        resolve_obj_by_qualname("CpuPlatform")
