"""Build llama.cpp (vendored in the llama-cpp-python sdist) as a benchmark peer, once, in a cache dir.

Usage: python benchmarks/peers/build_llama_cpp.py [--jobs 2] [--force] [--isa native|avx2]

The sdist of llama-cpp-python==VERSION contains a full llama.cpp tree in vendor/llama.cpp; we
configure it with -DGGML_NATIVE=ON (the same -march=native the pagemill kernels use) and build
llama-server, llama-bench, llama-batched-bench and llama-quantize into
$PAGEMILL_PEERS_DIR/llama.cpp-VERSION (default ~/.cache/pagemill/peers/llama.cpp-VERSION).
The same tree's convert_hf_to_gguf.py (run with its own gguf-py on PYTHONPATH, see converter())
turns an HF directory into a GGUF; benchmarks/models.py uses both to build models of real shapes.
When the binaries already exist it only prints their paths. `--isa avx2` builds for AVX2 + FMA + F16C only (no
AVX-512), the peer of pagemill's `avx2` variant (`PAGEMILL_CPU_ISA=avx2`) when a Zen 3-class CPU is not at hand;
give it its own PAGEMILL_PEERS_DIR. Stdlib only (no pagemill import).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

VERSION = "0.3.36"
TARGETS = ("llama-server", "llama-bench", "llama-batched-bench", "llama-quantize")
# ggml's CPU flags per --isa: the machine's own, or AVX2 + FMA + F16C without AVX-512.
ISA_FLAGS = {
    "native": ["-DGGML_NATIVE=ON"],
    "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
             "-DGGML_AVX512=OFF"],
}


def peers_dir() -> Path:
    """Root of the peers cache: $PAGEMILL_PEERS_DIR or ~/.cache/pagemill/peers."""
    env = os.environ.get("PAGEMILL_PEERS_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagemill" / "peers"


def install_dir(version: str = VERSION) -> Path:
    """Directory of one llama.cpp build (source tree + build/bin)."""
    return peers_dir() / f"llama.cpp-{version}"


def binaries(version: str = VERSION) -> dict[str, Path]:
    """Expected binary paths of a build."""
    bin_dir = install_dir(version) / "build" / "bin"
    return {name: bin_dir / name for name in TARGETS}


def source_tree(version: str = VERSION) -> Path:
    """The extracted llama.cpp source tree (vendor/llama.cpp of the sdist)."""
    return install_dir(version) / "src" / "vendor" / "llama.cpp"


def converter(version: str = VERSION) -> tuple[Path, Path]:
    """(convert_hf_to_gguf.py, its gguf-py directory): run the script with that directory on PYTHONPATH."""
    tree = source_tree(version)
    return tree / "convert_hf_to_gguf.py", tree / "gguf-py"


def _run(cmd: list[str], cwd: Path | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=cwd, check=True)


def fetch_source(version: str) -> Path:
    """Download (pip, sdist only) and extract llama-cpp-python; return its vendor/llama.cpp tree."""
    root = install_dir(version)
    src = root / "src"
    tree = source_tree(version)
    if (tree / "CMakeLists.txt").is_file():
        return tree
    download = peers_dir() / "downloads"
    download.mkdir(parents=True, exist_ok=True)
    sdist = download / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={version}", "-d", str(download)])
    if not sdist.is_file():  # older sdists use a dash in the file name
        found = sorted(download.glob(f"llama*cpp*python-{version}.tar.gz"))
        if not found:
            raise SystemExit(f"no sdist for llama-cpp-python {version} in {download}")
        sdist = found[0]
    tmp = root / "src.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp, filter="data")
    (top,) = [p for p in tmp.iterdir() if p.is_dir()]
    shutil.rmtree(src, ignore_errors=True)
    top.rename(src)
    shutil.rmtree(tmp, ignore_errors=True)
    if not (tree / "CMakeLists.txt").is_file():
        raise SystemExit(f"{sdist} has no vendor/llama.cpp/CMakeLists.txt")
    return tree


def build(version: str = VERSION, jobs: int = 2, isa: str = "native") -> dict[str, Path]:
    """Configure and build the peer binaries for `isa` (a key of ISA_FLAGS); return their paths."""
    if shutil.which("cmake") is None:
        raise SystemExit("cmake not found: apt-get install cmake (or pip install cmake)")
    tree = fetch_source(version)
    build_dir = install_dir(version) / "build"
    _run(["cmake", "-S", str(tree), "-B", str(build_dir), *ISA_FLAGS[isa],
          "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
          "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_SERVER=ON"])
    _run(["cmake", "--build", str(build_dir), f"-j{jobs}", "--target", *TARGETS])
    paths = binaries(version)
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise SystemExit(f"build finished but binaries are missing: {missing}")
    return paths


def main(argv: list[str] | None = None) -> int:
    """Build once (or print the existing binaries)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default=VERSION, help="llama-cpp-python sdist version")
    parser.add_argument("--jobs", "-j", type=int, default=2, help="parallel compile jobs")
    parser.add_argument("--force", action="store_true", help="rebuild even if binaries exist")
    parser.add_argument("--isa", choices=tuple(ISA_FLAGS), default="native",
                        help="native: this CPU's instructions; avx2: AVX2 + FMA + F16C only (use its own "
                             "PAGEMILL_PEERS_DIR)")
    args = parser.parse_args(argv)
    if args.isa != "native" and not os.environ.get("PAGEMILL_PEERS_DIR"):
        parser.error(f"--isa {args.isa}: set PAGEMILL_PEERS_DIR to a directory of its own (the default one holds "
                     "the native build, which the benchmarks use)")
    paths = binaries(args.version)
    if args.force or not all(p.is_file() for p in paths.values()):
        paths = build(args.version, args.jobs, args.isa)
    for name, path in paths.items():
        print(f"{name}: {path}")
    script, gguf_py = converter(args.version)
    print(f"convert_hf_to_gguf.py: {script} (PYTHONPATH={gguf_py})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
