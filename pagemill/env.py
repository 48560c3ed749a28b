"""`pagemill env`: the machine, ISA, kernel and library facts that decide speed (like `vllm collect-env`)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
from typing import Any

# CPU flags (as /proc/cpuinfo names them) that the kernels, torch or llama.cpp dispatch on.
X86_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
             "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx512vbmi", "avx_vnni", "gfni",
             "amx_tile", "amx_int8", "amx_bf16", "amx_fp16")
ARM_FLAGS = ("neon", "asimd", "asimdhp", "asimddp", "i8mm", "bf16", "sve", "sve2")
ENV_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "PAGEMILL_CPU_ISA")
PACKAGES = ("torch", "transformers", "numpy", "gguf")


def _cpuinfo() -> dict[str, str]:
    """The first processor block of /proc/cpuinfo as {key: value} ({} when unreadable)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    if info:
                        break
                    continue
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def cpu_flags(cpuinfo: dict[str, str] | None = None) -> dict[str, bool]:
    """The ISA flags that matter, each True/False (from /proc/cpuinfo `flags` or ARM `Features`)."""
    info = _cpuinfo() if cpuinfo is None else cpuinfo
    present = set((info.get("flags") or info.get("Features") or "").split())
    arm = platform.machine().lower() in ("aarch64", "arm64") or "Features" in info
    names = ARM_FLAGS if arm else X86_FLAGS
    if not present and arm and platform.system() == "Darwin":
        present = {"neon", "asimd"}  # every Apple silicon CPU has them
    return {name: name in present for name in names}


def _cache_sizes() -> dict[str, str]:
    """L1d/L2/L3 sizes from sysfs (cpu0's view), e.g. {'L2': '1024K', 'L3': '32768K'}."""
    sizes: dict[str, str] = {}
    root = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return sizes
    for entry in entries:
        if not entry.startswith("index"):
            continue
        try:
            with open(os.path.join(root, entry, "level"), encoding="utf-8") as f:
                level = f.read().strip()
            with open(os.path.join(root, entry, "type"), encoding="utf-8") as f:
                kind = f.read().strip()
            with open(os.path.join(root, entry, "size"), encoding="utf-8") as f:
                size = f.read().strip()
        except OSError:
            continue
        if kind == "Instruction":
            continue
        sizes[f"L{level}d" if level == "1" else f"L{level}"] = size
    return sizes


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _torch_info() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"torch_threads": None, "torch_cpu_capability": None}
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - older torch
        capability = None
    return {"torch_threads": torch.get_num_threads(), "torch_cpu_capability": capability}


def _kernel_info() -> dict[str, Any]:
    """`pagemill.kernels.kernel_info()` (it only loads a built module, never compiles)."""
    try:
        from pagemill.kernels import kernel_info

        return dict(kernel_info())
    except Exception as e:  # noqa: BLE001 - a broken build or a bad PAGEMILL_CPU_ISA is a fact to report
        return {"active": None, "error": f"{type(e).__name__}: {e}"}


def kv_cache_dtype_support(kernels: dict[str, Any]) -> dict[str, str]:
    """Which path runs attention per KV-cache dtype: float32 always; half and quantized types via the kernel when
    loaded."""
    half = "kernel" if kernels.get("active") else "torch reference"
    return {"float32": "kernel" if kernels.get("active") else "torch reference",
            "float16": half, "bfloat16": half, "int8": half, "fp8": half}


def _cpu_model(info: dict[str, str]) -> str | None:
    """x86 `model name`; on ARM Linux the implementer/part ids; else platform.processor()."""
    if info.get("model name") or info.get("Model"):
        return info.get("model name") or info.get("Model")
    if info.get("CPU implementer"):
        return f"ARM implementer {info['CPU implementer']} part {info.get('CPU part', '?')}"
    return platform.processor() or None


def _gpu_info() -> dict[str, Any]:
    """The GPU as the CUDA platform sees it (GPU, driver / CUDA versions, attention backend), or why there is none.
    Only asks torch.cuda where torch is a CUDA build."""
    try:
        import torch
    except ImportError:
        return {"available": False, "reason": "torch is not installed"}
    if torch.version.cuda is None:
        return {"available": False, "reason": "torch is a CPU build"}
    if not torch.cuda.is_available():
        return {"available": False, "reason": f"no CUDA device visible (torch CUDA {torch.version.cuda})"}
    from pagemill.platforms.cuda import CudaPlatform

    info: dict[str, Any] = {"available": True, **CudaPlatform.describe()}
    try:
        import subprocess

        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        info["driver"] = None
    return info


def collect_env() -> dict[str, Any]:
    """Everything `pagemill env` reports, as a JSON-safe dict."""
    info = _cpuinfo()
    kernels = _kernel_info()
    cpu = {
        "model": _cpu_model(info),
        # x86 family / model / stepping tell CPU generations apart when the model name does not (VMs: "AMD EPYC")
        "family_model_stepping": (f"{info['cpu family']}/{info['model']}/{info.get('stepping', '?')}"
                                  if info.get("cpu family") and info.get("model") else None),
        "architecture": platform.machine(),
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "flags": cpu_flags(info),
        "caches": _cache_sizes(),
    }
    return {
        "pagemill": _version("pagemill"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu,
        "kernels": kernels,
        "kv_cache_dtypes": kv_cache_dtype_support(kernels),
        "versions": {name: _version(name) for name in PACKAGES},
        **_torch_info(),
        "gpu": _gpu_info(),
        "env": {name: os.environ.get(name) for name in ENV_VARS},
    }


def format_env(env: dict[str, Any]) -> str:
    """Human-readable `key: value` lines of `collect_env()`."""
    cpu = env["cpu"]
    flags = cpu["flags"]
    lines = [
        f"pagemill: {env['pagemill']}",
        f"Python: {env['python']}",
        f"Platform: {env['platform']}",
        f"CPU: {cpu['model']}" + (f" (family/model/stepping {cpu['family_model_stepping']})"
                                  if cpu.get("family_model_stepping") else ""),
        f"Architecture: {cpu['architecture']}",
        f"Cores: {cpu['logical_cores']} logical, {cpu['usable_cores']} usable by this process",
        f"Caches: {', '.join(f'{k} {v}' for k, v in cpu['caches'].items()) or 'unknown'}",
        f"ISA flags present: {' '.join(k for k, v in flags.items() if v) or 'none'}",
        f"ISA flags absent: {' '.join(k for k, v in flags.items() if not v) or 'none'}",
        "Kernels:",
    ]
    lines += [f"  {k}: {v}" for k, v in env["kernels"].items()]
    lines.append("KV-cache dtypes: " + ", ".join(f"{k} ({v})" for k, v in env["kv_cache_dtypes"].items()))
    lines += [f"{name}: {version}" for name, version in env["versions"].items()]
    lines.append(f"torch threads: {env['torch_threads']}")
    lines.append(f"torch cpu capability: {env['torch_cpu_capability']}")
    gpu = env.get("gpu") or {}
    lines.append("GPU: " + (", ".join(f"{k} {v}" for k, v in gpu.items() if k != "available") if gpu.get("available")
                            else f"none ({gpu.get('reason')})"))
    lines += [f"{name}={value if value is not None else '(unset)'}" for name, value in env["env"].items()]
    return "\n".join(lines)


def main(as_json: bool = False) -> None:
    """Print the environment (JSON with `as_json`)."""
    env = collect_env()
    print(json.dumps(env, indent=2) if as_json else format_env(env))


if __name__ == "__main__":
    main()
