"""benchmarks/peers/build_llama_cpp.py's ISA choice: the cmake flags of each, and an AVX2-only build refused where it
would land in (and be mistaken for) the native build's directory."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("build_llama_cpp", REPO / "benchmarks/peers/build_llama_cpp.py")
build_llama_cpp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_llama_cpp)


def test_avx2_flags_turn_native_and_avx512_off():
    flags = build_llama_cpp.ISA_FLAGS["avx2"]
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AVX512=OFF" in flags and "-DGGML_AVX2=ON" in flags
    assert build_llama_cpp.ISA_FLAGS["native"] == ["-DGGML_NATIVE=ON"]


def test_avx2_build_needs_its_own_peers_dir(monkeypatch, capsys):
    monkeypatch.delenv("PAGEMILL_PEERS_DIR", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        build_llama_cpp.main(["--isa", "avx2"])
    assert exit_info.value.code == 2
    assert "PAGEMILL_PEERS_DIR" in capsys.readouterr().err
