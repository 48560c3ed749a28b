"""llama.cpp as a benchmark peer: output parsing, command lines, mode choice and the missing-binary error
(no binaries needed); an end-to-end run only where `benchmarks/peers/build_llama_cpp.py` has built them."""

from __future__ import annotations

import argparse
import importlib.util
import math
from pathlib import Path

import pytest

from pagemill.benchmarks import llama_cpp
from pagemill.benchmarks.backends import interleaved_times, make_backend, output_token_count, outputs_of
from pagemill.benchmarks.cli import build_parser
from pagemill.benchmarks.datasets import SampleRequest
from pagemill.benchmarks.llama_cpp import (BatchedBenchRow, LlamaCppNotFound, batched_bench_command,
                                           batched_bench_ctx, find_binary, parse_batched_bench,
                                           server_command, server_ctx)
from pagemill.benchmarks.llama_cpp_backend import TimedOutputs, choose_mode, uniform_shape
from pagemill.benchmarks.serve_peer import pagemill_server_command, per_slot_ctx

REPO = Path(__file__).resolve().parents[2]

# Captured from this build: llama-batched-bench -c 512 -npp 32 -ntg 15 -npl 2,2 -t 2 (stdout + stderr).
MARKDOWN_SAMPLE = """\

llama_batched_bench: n_kv_max = 512, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, \
is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    32 |     15 |    2 |     94 |    0.932 |    68.67 |    0.154 |   194.91 |    1.086 |    86.56 |
|    32 |     15 |    2 |     94 |    0.131 |   489.92 |    0.153 |   195.67 |    0.284 |   331.04 |

"""
# Captured with --output-format jsonl and -ntg 0 (the TTFT run): S_TG is printed as -nan, not valid JSON.
JSONL_SAMPLE = (
    '{"n_kv_max": 512, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, '
    '"n_threads": 2, "n_threads_batch": 2, "pp": 32, "tg": 0, "pl": 2, "n_kv": 64, "t_pp": 1.087885, '
    '"speed_pp": 58.829746, "t_tg": 0.000000, "speed_tg": -nan, "t": 1.087885, "speed": 58.829746}\n')

NO_BINARIES = not llama_cpp.binaries_available()
SKIP_REASON = ("llama.cpp peer binaries not built (run `python benchmarks/peers/build_llama_cpp.py`, ~6 min); "
               "CI does not build them")


def test_parse_markdown_table():
    rows = parse_batched_bench(MARKDOWN_SAMPLE)
    assert len(rows) == 2
    assert rows[1] == BatchedBenchRow(32, 15, 2, 94, 0.131, 489.92, 0.153, 195.67, 0.284, 331.04)


def test_parse_jsonl_with_nan():
    (row,) = parse_batched_bench(JSONL_SAMPLE)
    assert (row.pp, row.tg, row.pl, row.n_kv) == (32, 0, 2, 64)
    assert row.t_pp == pytest.approx(1.087885) and math.isnan(row.speed_tg)


def test_parse_ignores_other_lines():
    assert parse_batched_bench("| a | b |\nmain: nothing\n{\"x\": 1}\n") == []


def test_batched_bench_command_warms_up_then_measures():
    cmd = batched_bench_command("/bin/bb", "m.gguf", pp=256, tg=127, pl=32, threads=2)
    opt = {cmd[i]: cmd[i + 1] for i in range(1, len(cmd) - 1, 2)}
    assert opt["-m"] == "m.gguf" and opt["-npp"] == "256" and opt["-ntg"] == "127"
    assert opt["-npl"] == "1,32" and opt["-t"] == opt["-tb"] == "2" and opt["--output-format"] == "jsonl"
    assert int(opt["-c"]) >= 32 * (256 + 127)  # otherwise llama-batched-bench silently skips the row
    cold = batched_bench_command("/bin/bb", "m", 8, 0, 4, 1, warmup=False)
    assert cold[cold.index("-npl") + 1] == "4"
    assert batched_bench_ctx(1, 0, 1) == 256 and batched_bench_ctx(300, 0, 1) == 512


def test_server_command():
    cmd = server_command("/bin/ls", "m.gguf", 8123, threads=2, parallel=16, per_slot_ctx=300, alias="a")
    opt = {flag: cmd[cmd.index(flag) + 1] for flag in ("--host", "--port", "-np", "-c", "-t", "--alias")}
    assert "--no-webui" in cmd and opt["--host"] == "127.0.0.1" and opt["--port"] == "8123" and opt["-np"] == "16"
    assert opt["-c"] == str(16 * 512) == str(server_ctx(300, 16)) and opt["-t"] == "2" and opt["--alias"] == "a"


def test_missing_binaries_error_names_the_build_command(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEMILL_PEERS_DIR", str(tmp_path))
    monkeypatch.delenv("PAGEMILL_LLAMA_CPP_BIN", raising=False)
    with pytest.raises(LlamaCppNotFound, match="build_llama_cpp.py"):
        find_binary("llama-batched-bench")
    assert not llama_cpp.binaries_available()
    args = build_parser().parse_args(["bench", "latency", "--compare", "llama.cpp"])
    with pytest.raises(LlamaCppNotFound, match=str(tmp_path)):
        make_backend("llama.cpp", args, "m.gguf", 1, [(32, 8)])


def test_build_script_uses_the_same_cache_layout(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("build_llama_cpp", REPO / "benchmarks/peers/build_llama_cpp.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setenv("PAGEMILL_PEERS_DIR", str(tmp_path))
    monkeypatch.delenv("PAGEMILL_LLAMA_CPP_BIN", raising=False)
    assert script.VERSION == llama_cpp.VERSION and set(script.TARGETS) == {*llama_cpp.BINARIES, "llama-quantize"}
    assert script.binaries()["llama-server"].parent == llama_cpp.bin_dir()


def test_mode_choice_and_shapes():
    assert choose_mode("auto", [32] * 4, [8] * 4, max_num_seqs=128) == "batched-bench"
    assert choose_mode("auto", [32, 33], [8, 8], 128) == "server"
    assert choose_mode("auto", [32] * 200, [8] * 200, 128) == "server"  # more than one batch
    assert choose_mode("server", [32], [8], 128) == "server"
    with pytest.raises(ValueError):
        choose_mode("bogus", [1], [1], 1)
    assert uniform_shape([[1, 2], [3, 4]], [5, 5]) == (2, 5) and uniform_shape([[1], [2, 3]], [5, 5]) is None


def test_self_timed_results_replace_wall_time():
    class Fake:
        def generate(self, prompts, lens):
            return TimedOutputs(0.125, None, 42, {})

    class Plain:
        def generate(self, prompts, lens):
            return [[1, 2], [3]]

    times, last = interleaved_times({"a": Fake(), "b": Plain()}, lambda b: b.generate([], []), 2)
    assert times["a"] == [0.125, 0.125] and outputs_of(last["a"]) is None
    assert output_token_count(last["a"]) == 42 and output_token_count(last["b"]) == 3
    assert outputs_of(last["b"]) == [[1, 2], [3]]


def test_cli_flags():
    parse = build_parser().parse_args
    args = parse(["bench", "throughput", "--compare", "llama.cpp", "--llama-cpp-mode", "server",
                  "--llama-cpp-parallel", "4"])
    assert (args.compare, args.llama_cpp_mode, args.llama_cpp_parallel) == ("llama.cpp", "server", 4)
    args = parse(["bench", "serve", "--compare", "llama.cpp", "--pagemill-serve-args", "--max-num-seqs 16"])
    assert args.compare == "llama.cpp" and args.llama_cpp_parallel == 16 and args.launch_pagemill is None
    cmd = pagemill_server_command("m.gguf", 9000, args.pagemill_serve_args)
    assert cmd[-2:] == ["--max-num-seqs", "16"] and "--port" in cmd and "serve" in cmd
    sets = [[SampleRequest("a", 10, 20)], [SampleRequest("b", 100, 5)]]
    assert per_slot_ctx(sets) == 105 + 64


@pytest.mark.skipif(NO_BINARIES, reason=SKIP_REASON)
def test_latency_compare_end_to_end():
    from pagemill.benchmarks.latency import run_latency

    args = build_parser().parse_args([
        "bench", "latency", "--compare", "llama.cpp", "--batch-size", "1", "--input-len", "16",
        "--output-len", "8", "--num-iters", "1", "--num-iters-warmup", "0", "--threads", "2",
        "--max-model-len", "256", "--kv-cache-memory", "64MiB"])
    payload = run_latency(args)
    peer = payload["results"]["llama.cpp"]
    assert peer["llama_batched_bench"]["pp"] == 16 and peer["llama_batched_bench"]["tg"] == 7
    assert peer["ttft_s"] > 0 and peer["decode_tokens_per_s"] > 0 and "decode_per_token" in payload["speedup"]


@pytest.mark.skipif(NO_BINARIES, reason=SKIP_REASON)
def test_server_backend_returns_exact_lengths():
    from pagemill.benchmarks.llama_cpp_backend import LlamaServerBackend
    from pagemill.benchmarks.model_path import default_model_path

    backend = LlamaServerBackend(default_model_path(), threads=2, parallel=2, per_slot_ctx=64)
    try:
        out = backend.generate([[504, 3575, 282, 4649, 314], [504, 3575]], [5, 3])
    finally:
        backend.close()
    assert [len(o) for o in out] == [5, 3]


def test_peer_needs_a_gguf():
    args = argparse.Namespace(llama_cpp_mode="auto", llama_cpp_threads=2, threads=None, max_num_seqs=None,
                              llama_cpp_parallel=None)
    with pytest.raises(ValueError, match="GGUF"):
        make_backend("llama.cpp", args, "/some/hf_dir", 1, [(8, 8)])
