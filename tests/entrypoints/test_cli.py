"""The `pagemill` command line: flags generated from EngineArgs, served names, and real generate/chat runs."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from pagemill.engine.arg_utils import EngineArgs
from pagemill.entrypoints.cli import build_parser
from pagemill.entrypoints.openai.cli_args import engine_args_from_namespace, served_model_names


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
def test_every_engine_arg_has_a_flag_with_its_default(command):
    base = {"serve": ["serve"], "generate": ["generate", "hi"], "chat": ["chat", "hi"]}[command]
    args = build_parser().parse_args(base)
    parsed = engine_args_from_namespace(args)
    for f in dataclasses.fields(EngineArgs):
        if f.name == "disable_log_stats":
            continue
        assert getattr(parsed, f.name) == getattr(EngineArgs(), f.name), f.name
    assert parsed.disable_log_stats is (command != "serve")  # a server logs its stats line by default


def test_serve_flags_named_like_vllm():
    args = build_parser().parse_args([
        "serve", "/models/my-model", "--port", "9001", "--api-key", "k1", "--max-model-len", "512",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--block-size", "32", "--kv-cache-memory", "1GiB",
        "--no-enable-prefix-caching", "--dtype", "bfloat16", "--seed", "7", "--chat-template", "t.jinja"])
    e = engine_args_from_namespace(args)
    assert (e.model, e.max_model_len, e.max_num_seqs, e.max_num_batched_tokens, e.block_size) == \
        ("/models/my-model", 512, 8, 256, 32)
    assert (e.kv_cache_memory, e.enable_prefix_caching, e.dtype, e.seed) == ("1GiB", False, "bfloat16", 7)
    assert (args.host, args.port, args.api_key, args.chat_template) == ("127.0.0.1", 9001, ["k1"], "t.jinja")
    assert served_model_names(args) == ["my-model"]


def test_served_model_name_defaults():
    parse = build_parser().parse_args
    assert served_model_names(parse(["serve"])) == ["SmolLM2-135M-Instruct"]
    assert served_model_names(parse(["serve", "--model", "/x/y/model.gguf"])) == ["model.gguf"]
    args = parse(["serve", "--served-model-name", "a", "b"])
    assert served_model_names(args) == ["a", "b"] and engine_args_from_namespace(args).served_model_name == "a"


def test_generate_command(tmp_path):
    """`pagemill generate` loads the default model and prints one block per prompt (arguments and file)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Water boils at\n\n")
    r = subprocess.run([sys.executable, "-m", "pagemill.entrypoints.cli", "generate", "The capital of France is",
                        "--prompts-file", str(prompts), "--max-tokens", "4", "--max-model-len", "512",
                        "--kv-cache-memory", "64MiB"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("=== prompt") == 2 and "=== prompt 1, output 0 ===" in r.stdout
    assert "Paris" in r.stdout.split("=== prompt 1")[0]


def test_bad_arguments_exit_with_one_line():
    r = subprocess.run([sys.executable, "-m", "pagemill.entrypoints.cli", "generate", "hi", "--model",
                        "/no/such/model.gguf"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_env_command_json():
    """`pagemill env --json` prints the machine, ISA, kernel and library facts as JSON."""
    import json

    r = subprocess.run([sys.executable, "-m", "pagemill.entrypoints.cli", "env", "--json"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    env = json.loads(r.stdout)
    for key in ("cpu", "kernels", "kv_cache_dtypes", "versions", "torch_threads", "torch_cpu_capability", "env"):
        assert key in env, key
    assert env["cpu"]["architecture"] and env["cpu"]["logical_cores"] >= 1 and env["cpu"]["flags"]
    kernel_keys = {"active", "compiled", "supported", "forced", "split_zmm_units", "build_error", "path"}
    assert kernel_keys <= set(env["kernels"]) or "error" in env["kernels"]
    assert env["kv_cache_dtypes"]["float32"]
    assert set(env["kv_cache_dtypes"]) == {"float32", "float16", "bfloat16", "int8", "fp8"}
    assert env["versions"]["torch"] and set(env["env"]) >= {"OMP_NUM_THREADS", "OMP_WAIT_POLICY", "PAGEMILL_CPU_ISA"}


def test_env_text_and_flags():
    """The text form names every section; flags parse from x86 `flags` and ARM `Features` lines."""
    from pagemill.env import collect_env, cpu_flags, format_env, kv_cache_dtype_support

    text = format_env(collect_env())
    for label in ("CPU:", "ISA flags present:", "Kernels:", "KV-cache dtypes:", "torch cpu capability:",
                  "OMP_WAIT_POLICY="):
        assert label in text
    x86 = cpu_flags({"flags": "fpu sse4_2 avx avx2 fma avx512f avx512_bf16"})
    assert x86["avx2"] and x86["avx512_bf16"] and not x86["avx512_fp16"] and not x86["amx_tile"]
    arm = cpu_flags({"Features": "fp asimd asimdhp sve i8mm"})
    assert arm["asimd"] and arm["sve"] and not arm["sve2"] and "avx2" not in arm
    assert kv_cache_dtype_support({"active": None})["float16"] == "torch reference"
    assert kv_cache_dtype_support({"active": "avx2"})["bfloat16"] == "kernel"


def test_env_models_lists_every_registered_family():
    """`pagemill env --models` lists each family's HF architecture, and the GGUF architectures run from files."""
    from pagemill.models.registry import MODEL_FAMILIES

    r = subprocess.run([sys.executable, "-m", "pagemill.entrypoints.cli", "env", "--models"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert len(lines) == 1 + len(MODEL_FAMILIES)
    for family in MODEL_FAMILIES:
        row = next(line for line in lines if family.architecture in line)
        assert family.model_type in row.split()
    assert any("gemma3_text" in line and line.rstrip().endswith("gemma3") for line in lines)
