"""Build (once, at install) and load pagemill's compiled CPU extensions: the kernels and the shared-memory
communicator.

The kernels in `csrc/cpu/variant/` are compiled once per ISA variant with that variant's explicit flags (never
`-march=native`), into objects linked with the torch bindings (`bindings.cpp`, `packing.cpp` beside them, baseline
flags) as one extension module. The module picks the best variant the CPU runs when it is imported;
`PAGEMILL_CPU_ISA=<variant>` forces one. The tensor-parallel ranks' shared-memory all-reduce (`csrc/shm/shm_comm.cpp`)
is its own small extension (`pagemill_shm`, baseline flags), with its own cache key: a kernel change does not
rebuild it, nor the reverse. A process only loads a built module: it never compiles. When a build failed (no
compiler, say), that is remembered and reported in one line, and the torch (gloo) paths are used.

`python -m pagemill.kernels.build` builds; `--strict` exits non-zero on failure (CI), `--cross-check CXX` also
compiles the portable variant with another compiler (e.g. aarch64-linux-gnu-g++) to prove it builds there.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from types import ModuleType

logger = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(os.path.dirname(__file__)), "csrc")
_CPU_SRC = os.path.join(_CSRC, "cpu")  # the CPU kernels (csrc/cuda/ is the CUDA platform's room)
_SHM_SRC = os.path.join(_CSRC, "shm")  # the shared-memory communicator extension
MODULE_NAME = "pagemill_kernels"
SHM_MODULE_NAME = "pagemill_shm"
ISA_ENV = "PAGEMILL_CPU_ISA"
# Explicit flags per variant, best first. Each needs exactly the CPU features the bindings check at run time.
X86_VARIANTS: dict[str, list[str]] = {
    "avx512_vbmi": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vbmi", "-mgfni", "-mavx512vnni",
                    "-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "generic": ["-march=x86-64", "-mtune=generic"],
}
_SYSTEM_LIBS = ["-lrt"] if sys.platform.startswith("linux") else []  # shm_open on glibc < 2.34
_VARIANT_CFLAGS = ["-O3", "-fPIC", "-std=c++17", "-fopenmp", "-ffast-math", "-fno-exceptions", "-Wall"]
_SHM_CFLAGS = ["-O3"]

_module: ModuleType | None = None
_failed = False
_shm_module: ModuleType | None = None
_shm_failed = False


def variant_flags(machine: str | None = None) -> dict[str, list[str]]:
    """The variants built for a target machine (`platform.machine()` names): x86-64 gets all, others `generic`."""
    machine = (machine or platform.machine()).lower()
    return dict(X86_VARIANTS) if machine in ("x86_64", "amd64") else {"generic": []}


def _variant_sources() -> list[str]:
    return sorted(glob.glob(os.path.join(_CPU_SRC, "variant", "*.cpp")))


def _binding_sources() -> list[str]:
    return [os.path.join(_CPU_SRC, name) for name in ("bindings.cpp", "packing.cpp", "gguf_rows.cpp", "kv_rows.cpp",
                                                         "decoder_graph.cpp")]


def _shm_sources() -> list[str]:
    return [os.path.join(_SHM_SRC, "shm_comm.cpp")]


def _cache_dir(prefix: str, base: str, paths: list[str], flags: str) -> str:
    """A build directory keyed by a hash of `paths` (names relative to `base`, and contents), flags, torch, Python
    and the machine type."""
    import torch

    digest = hashlib.sha256(f"{torch.__version__}|{sys.version_info[:2]}|{platform.machine()}|{flags}".encode())
    for path in sorted(paths):
        with open(path, "rb") as f:
            digest.update(os.path.relpath(path, base).encode() + f.read())
    from pagemill.utils.cache_dirs import cache_root

    return os.path.join(cache_root(), f"{prefix}_{digest.hexdigest()[:12]}")


def build_dir() -> str:
    """Where this source tree's kernel build lives: a hash of the kernel sources (csrc/cpu/), flags, torch, Python
    and the machine type."""
    paths = [p for p in glob.glob(os.path.join(_CPU_SRC, "**", "*"), recursive=True) if os.path.isfile(p)]
    return _cache_dir("kernels", _CPU_SRC, paths, f"{variant_flags()}|{_VARIANT_CFLAGS}")


def shm_build_dir() -> str:
    """Where the shared-memory communicator's build lives: a hash of its sources and the same environment."""
    return _cache_dir("shm", _SHM_SRC, _shm_sources(), "|".join(_SHM_CFLAGS + _SYSTEM_LIBS))


def module_path(directory: str | None = None) -> str:
    """The built kernel extension's path (it may not exist)."""
    return os.path.join(directory or build_dir(), "ext", f"{MODULE_NAME}.so")


def shm_module_path(directory: str | None = None) -> str:
    """The built shared-memory communicator's path (it may not exist)."""
    return os.path.join(directory or shm_build_dir(), "ext", f"{SHM_MODULE_NAME}.so")


def _error_path(directory: str) -> str:
    return os.path.join(directory, "build_error.txt")


def _compile_variant(cxx: str, name: str, flags: list[str], out_dir: str) -> list[str]:
    """Compile every variant source for one ISA; returns the object paths (raises with the compiler's output)."""
    os.makedirs(out_dir, exist_ok=True)
    objects = []
    for src in _variant_sources():
        obj = os.path.join(out_dir, os.path.basename(src).replace(".cpp", ".o"))
        cmd = [cxx, "-c", *_VARIANT_CFLAGS, *flags, f"-DPAGEMILL_ISA={name}", src, "-o", obj]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"variant {name}: {' '.join(cmd)}\n{proc.stderr[-4000:]}")
        objects.append(obj)
    return objects


def compile_variants(cxx: str, variants: dict[str, list[str]], out_root: str) -> list[str]:
    """Compile the variants in parallel (one job per core); returns all object paths."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        jobs = [pool.submit(_compile_variant, cxx, name, flags, os.path.join(out_root, name))
                for name, flags in variants.items()]
        return [obj for job in jobs for obj in job.result()]


def _build_once(directory: str, path: str, compile_into: Callable[[str], None]) -> str:
    """`path` when built, else `compile_into(directory)` (a failure is written to the directory's error file, so
    no later process tries again) and `path`."""
    if os.path.exists(path):
        return path
    os.makedirs(directory, exist_ok=True)
    if os.path.exists(_error_path(directory)):
        os.remove(_error_path(directory))
    try:
        compile_into(directory)
    except Exception as e:
        with open(_error_path(directory), "w", encoding="utf-8") as f:
            f.write(f"{type(e).__name__}: {e}\n")
        raise
    return path


def build(verbose: bool = False) -> str:
    """Build the kernel extension for this machine (all its variants) and return its path; raises on failure."""
    from torch.utils.cpp_extension import load

    def compile_into(directory: str) -> None:
        objects = compile_variants(os.environ.get("CXX", "c++"), variant_flags(), os.path.join(directory, "variants"))
        ext_dir = os.path.join(directory, "ext")
        os.makedirs(ext_dir, exist_ok=True)
        load(name=MODULE_NAME, sources=_binding_sources(), build_directory=ext_dir, extra_cflags=["-O3"],
             extra_ldflags=[*objects, "-fopenmp"], extra_include_paths=[_CPU_SRC], verbose=verbose)

    directory = build_dir()
    return _build_once(directory, module_path(directory), compile_into)


def build_shm(verbose: bool = False) -> str:
    """Build the shared-memory communicator extension and return its path; raises on failure."""
    from torch.utils.cpp_extension import load

    def compile_into(directory: str) -> None:
        ext_dir = os.path.join(directory, "ext")
        os.makedirs(ext_dir, exist_ok=True)
        load(name=SHM_MODULE_NAME, sources=_shm_sources(), build_directory=ext_dir, extra_cflags=_SHM_CFLAGS,
             extra_ldflags=_SYSTEM_LIBS, verbose=verbose)

    directory = shm_build_dir()
    return _build_once(directory, shm_module_path(directory), compile_into)


def cross_check(cxx: str) -> None:
    """Compile the portable variant and the bindings with another compiler (e.g. for aarch64), objects only."""
    import sysconfig
    import tempfile

    from torch.utils.cpp_extension import include_paths

    with tempfile.TemporaryDirectory() as tmp:
        compile_variants(cxx, {"generic": []}, tmp)
        includes = [f"-I{p}" for p in (*include_paths(), sysconfig.get_paths()["include"], _CPU_SRC)]
        for src, module in [(s, MODULE_NAME) for s in _binding_sources()] + [(s, SHM_MODULE_NAME)
                                                                             for s in _shm_sources()]:
            obj = os.path.join(tmp, os.path.basename(src) + ".o")
            cmd = [cxx, "-c", "-O1", "-fPIC", "-std=c++17", *includes, f"-DTORCH_EXTENSION_NAME={module}",
                   "-DTORCH_API_INCLUDE_EXTENSION_H", src, "-o", obj]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)}\n{proc.stderr[-4000:]}")


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "unknown error"


def _import(path: str, name: str = MODULE_NAME) -> ModuleType:
    import torch  # noqa: F401  (the extension links against libtorch)

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _apply_forced_isa(module: ModuleType) -> None:
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if forced in ("", "auto"):
        return
    try:
        module.set_isa(forced)
    except RuntimeError as e:
        raise RuntimeError(f"{ISA_ENV}={forced}: {_first_line(str(e))} (this CPU runs: "
                           f"{', '.join(module.supported_isas())})") from None


def load_kernels() -> ModuleType | None:
    """The built kernel module with its ISA variant chosen, or None (one warning) when it is not built."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    directory = build_dir()
    path = module_path(directory)
    if os.path.exists(path):
        module = _import(path)
        _apply_forced_isa(module)
        _module = module
        return _module
    _failed = True
    if os.path.exists(_error_path(directory)):
        with open(_error_path(directory), encoding="utf-8") as f:
            reason = f"the build failed: {_first_line(f.read())}"
    else:
        reason = "they were never built for this source tree"
    logger.warning("pagemill's CPU kernels are unavailable (%s); using the torch reference paths. Fix: install a "
                   "C++ compiler (g++) and run `python -m pagemill.kernels.build` (make install does).", reason)
    return None


def load_shm_comm() -> tuple[ModuleType | None, str | None]:
    """(the built shared-memory communicator extension, None) or (None, why it is unavailable); never compiles."""
    global _shm_module, _shm_failed
    if _shm_module is None and not _shm_failed:
        directory = shm_build_dir()
        if os.path.exists(shm_module_path(directory)):
            _shm_module = _import(shm_module_path(directory), SHM_MODULE_NAME)
        _shm_failed = _shm_module is None
    if _shm_module is not None:
        return _shm_module, None
    error = _error_path(shm_build_dir())
    if os.path.exists(error):
        with open(error, encoding="utf-8") as f:
            return None, f"its build failed: {_first_line(f.read())}"
    return None, "it was never built for this source tree (python -m pagemill.kernels.build)"


def kernel_info() -> dict:
    """What `pagemill env` reports about the kernels: active variant, compiled and supported ones, build error, and
    the shm communicator extension."""
    module = load_kernels()
    directory = build_dir()
    error = None
    if module is None and os.path.exists(_error_path(directory)):
        with open(_error_path(directory), encoding="utf-8") as f:
            error = _first_line(f.read())
    return {
        "active": module.isa() if module else None,
        "compiled": list(module.compiled_isas()) if module else [],
        "supported": list(module.supported_isas()) if module else [],
        "forced": os.environ.get(ISA_ENV) or None,
        # one-row float kernels unpack without byte permutes on cores with split 512-bit units (Zen 4)
        "split_zmm_units": bool(module.split_zmm_units()) if module else None,
        "build_error": error if module is None else None,
        "path": module_path(directory) if module else None,
        "shm_comm": _shm_line(),
    }


def _shm_line() -> str:
    """The shm communicator extension's path, or why it is unavailable."""
    module, reason = load_shm_comm()
    return module.__file__ if module is not None else f"unavailable: {reason}"


def main(argv: list[str] | None = None) -> int:
    """Build the kernels and the shm communicator (`make install` runs this)."""
    parser = argparse.ArgumentParser(prog="python -m pagemill.kernels.build", description=__doc__.split("\n")[0])
    parser.add_argument("--strict", action="store_true", help="exit non-zero when the build fails (CI)")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--cross-check", metavar="CXX", help="also compile the portable variant with this compiler")
    args = parser.parse_args(argv)
    failures = []
    try:
        shm_path = build_shm(verbose=args.verbose)
    except Exception as e:
        failures.append(f"shm communicator ({_first_line(str(e))}; gloo will be used; {_error_path(shm_build_dir())})")
    try:
        path = build(verbose=args.verbose)
    except Exception as e:
        failures.insert(0, f"kernels ({_first_line(str(e))}; the torch reference paths will be used; "
                           f"{_error_path(build_dir())})")
    if failures:  # one line, whatever failed
        print(f"pagemill kernels: build failed: {'; '.join(failures)}", file=sys.stderr)
        return 1 if args.strict else 0
    module = _import(path)
    print(f"pagemill kernels: {path}\n  compiled: {', '.join(module.compiled_isas())}\n"
          f"  this CPU runs: {', '.join(module.supported_isas())} (active: {module.isa()})\n"
          f"pagemill shm communicator: {shm_path}")
    if args.cross_check:
        if shutil.which(args.cross_check) is None:
            print(f"pagemill kernels: cross compiler {args.cross_check} not found", file=sys.stderr)
            return 1
        cross_check(args.cross_check)
        print(f"  portable variant compiles with {args.cross_check}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
