"""The kernel build: every variant compiled with its own flags, loaded without recompiling, failures remembered."""

from __future__ import annotations

import glob
import os
import platform
import shutil
import subprocess
import sys
import time

import pytest

from pagemill.kernels import build
from pagemill.kernels.build import load_kernels
from tests.conftest import requires_kernels

kernels = load_kernels()
X86 = platform.machine().lower() in ("x86_64", "amd64")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def _python(code: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)


@requires_kernels
def test_every_variant_is_compiled():
    assert list(kernels.compiled_isas()) == list(build.variant_flags())
    assert kernels.supported_isas()[-1] == "generic"


@requires_kernels
@pytest.mark.skipif(not (X86 and os.path.exists("/proc/cpuinfo")), reason="x86 Linux: compares with /proc/cpuinfo")
def test_supported_variants_follow_cpu_flags():
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    avx2 = {"avx2", "fma", "f16c"} <= flags
    avx512 = avx2 and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    expected = {"avx512_vbmi": avx512 and {"avx512vbmi", "gfni"} <= flags, "avx512": avx512, "avx2": avx2,
                "generic": True}
    assert list(kernels.supported_isas()) == [name for name in kernels.compiled_isas() if expected[name]]


@requires_kernels
def test_variant_objects_share_no_symbols():
    """An inline function compiled for AVX-512 must not stand in for the generic one: each variant's objects may
    define only symbols of their own namespace (no std:: template instantiations, nothing shared)."""
    if shutil.which("nm") is None:
        pytest.skip("nm not installed")
    variants = os.path.join(build.build_dir(), "variants")
    for name in build.variant_flags():
        objects = glob.glob(os.path.join(variants, name, "*.o"))
        assert objects, f"no objects for variant {name}"
        # Mangled names: a function template's demangled form starts with its return type, its mangled one with
        # its namespace (_ZN8pagemill<len><variant>...).
        own = (f"_ZN8pagemill{len(name)}{name}", f"_ZN8pagemill{len(f'kernel_table_{name}')}kernel_table_{name}E")
        out = subprocess.run(["nm", "--defined-only", *objects], capture_output=True, text=True, check=True)
        for line in out.stdout.splitlines():
            parts = line.split(maxsplit=2)
            if len(parts) < 3 or parts[1] in "tdbrn" or parts[2].startswith(("DW.ref.", ".L")):
                continue  # local symbols and the unwinder's data reference
            assert parts[2].startswith(own), f"{name}: exported symbol outside its namespace: {parts[2]}"


@requires_kernels
def test_second_process_loads_without_compiling():
    """No compiler reachable (PATH emptied, CXX broken): the built module still loads, fast, and is not rebuilt."""
    path = build.module_path()
    mtime = os.path.getmtime(path)
    env = {**os.environ, "PATH": "/nonexistent", "CXX": "/bin/false", "PYTHONPATH": ROOT}
    start = time.perf_counter()
    proc = _python("from pagemill.kernels import load_kernels; k = load_kernels(); print(k.isa())", env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == kernels.isa()
    assert "unavailable" not in proc.stderr
    assert time.perf_counter() - start < 60
    assert os.path.getmtime(path) == mtime


def test_failed_build_is_remembered(tmp_path):
    """With no working compiler the build fails once, says so in one line, and later processes do not retry."""
    env = {**os.environ, "PAGEMILL_CACHE_DIR": str(tmp_path), "CXX": "/bin/false", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-m", "pagemill.kernels.build"], capture_output=True, text=True,
                          env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr  # make install goes on: the torch paths work
    assert "build failed" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    strict = subprocess.run([sys.executable, "-m", "pagemill.kernels.build", "--strict"], capture_output=True,
                            text=True, env=env, timeout=300, cwd=ROOT)
    assert strict.returncode == 1
    code = ("import logging; logging.basicConfig(); from pagemill.kernels import load_kernels, kernel_info; "
            "assert load_kernels() is None; print(kernel_info()['build_error'])")
    proc = _python(code, env)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "kernels are unavailable" in line]
    assert len(warnings) == 1 and "build failed" in warnings[0] and "pagemill.kernels.build" in warnings[0]
    assert proc.stdout.strip()  # the reason, for `pagemill env`
    assert not glob.glob(os.path.join(str(tmp_path), "*", "ext", "*.so"))


@requires_kernels
def test_forcing_a_variant_the_cpu_lacks_is_an_error():
    env = {**os.environ, "PAGEMILL_CPU_ISA": "sse9", "PYTHONPATH": ROOT}
    proc = _python("from pagemill.kernels import load_kernels; load_kernels()", env)
    assert proc.returncode != 0 and "PAGEMILL_CPU_ISA=sse9" in proc.stderr and "unknown kernel variant" in proc.stderr
    with pytest.raises(RuntimeError, match="unknown kernel variant"):
        kernels.set_isa("sse9")
    missing = [name for name in kernels.compiled_isas() if name not in kernels.supported_isas()]
    if missing:
        with pytest.raises(RuntimeError, match="lacks"):
            kernels.set_isa(missing[0])


CROSS = "aarch64-linux-gnu-g++"


@pytest.mark.skipif(shutil.which(CROSS) is None, reason=f"{CROSS} not installed (.ci/run installs it)")
def test_portable_variant_compiles_for_aarch64():
    build.cross_check(CROSS)


@requires_kernels
def test_shm_communicator_is_its_own_extension():
    """The shm all-reduce is a separate module with its own cache key (a kernel edit does not rebuild it); the
    kernel module no longer carries it."""
    shm, reason = build.load_shm_comm()
    assert shm is not None, reason
    assert hasattr(shm, "ShmComm") and not hasattr(kernels, "ShmComm")
    assert os.path.dirname(build.shm_module_path()) != os.path.dirname(build.module_path())
    assert shm.__name__ == build.SHM_MODULE_NAME and kernels.__name__ == build.MODULE_NAME
