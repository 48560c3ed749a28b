"""Build (once, at install) and load pagemill's compiled CPU kernels.

The kernels in `csrc/variant/` are compiled once per ISA variant with that variant's explicit flags (never
`-march=native`), into objects linked with the torch bindings (`csrc/bindings.cpp`, `csrc/packing.cpp`, baseline
flags) as one extension module. The module picks the best variant the CPU runs when it is imported;
`PAGEMILL_CPU_ISA=<variant>` forces one. A process only loads the built module: it never compiles. When the
build failed (no compiler, say), that is remembered and reported in one line, and the torch paths are used.

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
from types import ModuleType

logger = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(os.path.dirname(__file__)), "csrc")
MODULE_NAME = "pagemill_kernels"
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

_module: ModuleType | None = None
_failed = False


def variant_flags(machine: str | None = None) -> dict[str, list[str]]:
    """The variants built for a target machine (`platform.machine()` names): x86-64 gets all, others `generic`."""
    machine = (machine or platform.machine()).lower()
    return dict(X86_VARIANTS) if machine in ("x86_64", "amd64") else {"generic": []}


def _variant_sources() -> list[str]:
    return sorted(glob.glob(os.path.join(_CSRC, "variant", "*.cpp")))


def _binding_sources() -> list[str]:
    return [os.path.join(_CSRC, name) for name in ("bindings.cpp", "packing.cpp", "gguf_rows.cpp", "shm_comm.cpp")]


def build_dir() -> str:
    """Where this source tree's build lives: a hash of the sources, flags, torch, Python and the machine type."""
    import torch

    flags = f"{variant_flags()}|{_VARIANT_CFLAGS}"
    digest = hashlib.sha256(f"{torch.__version__}|{sys.version_info[:2]}|{platform.machine()}|{flags}".encode())
    for path in sorted(glob.glob(os.path.join(_CSRC, "**", "*"), recursive=True)):
        if os.path.isfile(path):
            with open(path, "rb") as f:
                digest.update(os.path.relpath(path, _CSRC).encode() + f.read())
    root = os.environ.get("PAGEMILL_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "pagemill"))
    return os.path.join(root, f"kernels_{digest.hexdigest()[:12]}")


def module_path(directory: str | None = None) -> str:
    """The built extension's path (it may not exist)."""
    return os.path.join(directory or build_dir(), "ext", f"{MODULE_NAME}.so")


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


def build(verbose: bool = False) -> str:
    """Build the extension for this machine (all its variants) and return its path; raises on failure."""
    from torch.utils.cpp_extension import load

    directory = build_dir()
    if os.path.exists(module_path(directory)):
        return module_path(directory)
    os.makedirs(directory, exist_ok=True)
    if os.path.exists(_error_path(directory)):
        os.remove(_error_path(directory))
    cxx = os.environ.get("CXX", "c++")
    try:
        objects = compile_variants(cxx, variant_flags(), os.path.join(directory, "variants"))
        ext_dir = os.path.join(directory, "ext")
        os.makedirs(ext_dir, exist_ok=True)
        load(name=MODULE_NAME, sources=_binding_sources(), build_directory=ext_dir,
             extra_cflags=["-O3"], extra_ldflags=[*objects, "-fopenmp", *_SYSTEM_LIBS], extra_include_paths=[_CSRC],
             verbose=verbose)
    except Exception as e:  # remembered, so no later process tries again
        with open(_error_path(directory), "w", encoding="utf-8") as f:
            f.write(f"{type(e).__name__}: {e}\n")
        raise
    return module_path(directory)


def cross_check(cxx: str) -> None:
    """Compile the portable variant and the bindings with another compiler (e.g. for aarch64), objects only."""
    import sysconfig
    import tempfile

    from torch.utils.cpp_extension import include_paths

    with tempfile.TemporaryDirectory() as tmp:
        compile_variants(cxx, {"generic": []}, tmp)
        includes = [f"-I{p}" for p in (*include_paths(), sysconfig.get_paths()["include"], _CSRC)]
        for src in _binding_sources():
            obj = os.path.join(tmp, os.path.basename(src) + ".o")
            cmd = [cxx, "-c", "-O1", "-fPIC", "-std=c++17", *includes, f"-DTORCH_EXTENSION_NAME={MODULE_NAME}",
                   "-DTORCH_API_INCLUDE_EXTENSION_H", src, "-o", obj]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)}\n{proc.stderr[-4000:]}")


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "unknown error"


def _import(path: str) -> ModuleType:
    import torch  # noqa: F401  (the extension links against libtorch)

    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
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


def kernel_info() -> dict:
    """What `pagemill env` reports about the kernels: active variant, compiled and supported ones, build error."""
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
        "build_error": error if module is None else None,
        "path": module_path(directory) if module else None,
    }


def main(argv: list[str] | None = None) -> int:
    """Build the kernels (`make install` runs this)."""
    parser = argparse.ArgumentParser(prog="python -m pagemill.kernels.build", description=__doc__.split("\n")[0])
    parser.add_argument("--strict", action="store_true", help="exit non-zero when the build fails (CI)")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--cross-check", metavar="CXX", help="also compile the portable variant with this compiler")
    args = parser.parse_args(argv)
    try:
        path = build(verbose=args.verbose)
    except Exception as e:
        print(f"pagemill kernels: build failed ({_first_line(str(e))}); the torch reference paths will be used. "
              f"Details: {_error_path(build_dir())}", file=sys.stderr)
        return 1 if args.strict else 0
    module = _import(path)
    print(f"pagemill kernels: {path}\n  compiled: {', '.join(module.compiled_isas())}\n"
          f"  this CPU runs: {', '.join(module.supported_isas())} (active: {module.isa()})")
    if args.cross_check:
        if shutil.which(args.cross_check) is None:
            print(f"pagemill kernels: cross compiler {args.cross_check} not found", file=sys.stderr)
            return 1
        cross_check(args.cross_check)
        print(f"  portable variant compiles with {args.cross_check}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
