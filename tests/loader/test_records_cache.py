"""The records cache: the first start lays a GGUF's records out and writes them; a second start maps them (no
packing at all) and generates the same tokens; an edited file or a damaged cache is repacked; loading costs about
the file's size in resident memory."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pagemill.layers.quantization.gguf as gguf_method
from pagemill.layers.head_screen import GreedyHeadScreen
from pagemill.layers.quantization.records_cache import RecordsCache, wait_for_writes
from pagemill import LLM, SamplingParams
from tests.conftest import SMOL_PROMPTS, requires_kernels

pytestmark = requires_kernels

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def _start(path: str) -> LLM:
    """An engine on `path`, its records cache written (the write runs on a thread of its own)."""
    llm = LLM(path, kv_cache_memory="64MiB", max_model_len=256)
    wait_for_writes()
    return llm


def _close(llm: LLM) -> None:
    del llm
    gc.collect()


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(SMOL_PROMPTS[:4], GREEDY, use_tqdm=False)]


def _cache_files(root: Path) -> list[Path]:
    """The records files (not the head screen's, beside them)."""
    return sorted(p for p in root.glob("*.safetensors") if ".head_screen." not in p.name)


def _forbid_packing(monkeypatch: pytest.MonkeyPatch) -> None:
    def packing(*args, **kwargs):
        raise AssertionError("records were packed although the cache holds them")

    monkeypatch.setattr(gguf_method, "pack_records", packing)
    monkeypatch.setattr(GreedyHeadScreen, "_pack_from_blocks", packing)


def test_second_start_maps_the_records_without_packing(smol_path, cache_dir, monkeypatch):
    """Records and the greedy head screen of the quantized head both come from the cache on the second start."""
    first = _start(smol_path)
    want = _tokens(first)
    del first
    gc.collect()
    files = _cache_files(cache_dir)
    assert len(files) == 1 and files[0].stat().st_size > 50e6  # SmolLM2's 30 layers x 7 linears of records
    _forbid_packing(monkeypatch)
    second = _start(smol_path)
    assert _tokens(second) == want
    assert _cache_files(cache_dir) == files  # nothing rewritten
    screen = second.llm_engine.engine_core.executor.model_runner.head_screen
    assert screen is not None and screen.recomputed > 0  # the mapped screen ran (and rechecked its candidates)


_EXIT_AFTER_START = """
import sys
from pagemill import LLM
LLM(sys.argv[1], kv_cache_memory="32MiB", max_model_len=256)
"""


def test_the_write_finishes_before_the_process_exits(smol_path, cache_dir):
    """The cache is written on a thread of its own while the engine serves; a process that exits right after the
    start still leaves the whole file (and no temporary one), which the next start maps."""
    env = {**os.environ, "PAGEMILL_RECORDS_CACHE_DIR": str(cache_dir)}
    proc = subprocess.run([sys.executable, "-c", _EXIT_AFTER_START, smol_path], capture_output=True, text=True,
                          env=env, timeout=300, cwd=str(Path(__file__).resolve().parents[2]))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not list(cache_dir.glob("*.tmp"))
    (path,) = _cache_files(cache_dir)
    cache = RecordsCache(path)
    assert cache.mapped and cache._index  # a complete safetensors file with its index


def test_an_orphaned_temporary_file_is_removed(smol_path, cache_dir):
    """A writer killed mid-write leaves its temporary file; the next write removes it (its process is gone)."""
    cache_dir.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = cache_dir / f"{dead.stdout.strip()}.abc.tmp"
    orphan.write_bytes(b"partial")
    _close(_start(smol_path))
    assert not orphan.exists() and _cache_files(cache_dir)


def test_an_edited_file_gets_new_records(smol_path, cache_dir, tmp_path, monkeypatch):
    """The cache key has the file's size and modification time: a changed file never reads the old records (and
its old records do not stay on disk)."""
    copy = tmp_path / "model.gguf"
    shutil.copyfile(smol_path, copy)
    _close(_start(str(copy)))
    (old,) = _cache_files(cache_dir)
    st = copy.stat()
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    _close(_start(str(copy)))
    (new,) = _cache_files(cache_dir)  # the old version's records are removed once the new ones are written
    assert new != old
    assert len(list(cache_dir.glob("*.safetensors"))) <= 2  # with its head screen, if the head has one


def test_a_damaged_cache_file_is_repacked(smol_path, cache_dir, caplog):
    want = _tokens(_start(smol_path))
    (path,) = _cache_files(cache_dir)
    path.write_bytes(path.read_bytes()[:4096])  # cut short, as by a full disk
    gc.collect()
    assert _tokens(_start(smol_path)) == want
    assert "unreadable records cache" in caplog.text


def test_cache_off(smol_path, cache_dir, monkeypatch):
    monkeypatch.setenv("PAGEMILL_RECORDS_CACHE", "0")
    _close(_start(smol_path))
    assert not cache_dir.exists() or not _cache_files(cache_dir)


_RSS_SCRIPT = """
import json, resource, sys
def rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
import torch, transformers, tokenizers  # the runtime's own memory, before any model
from pagemill import LLM, SamplingParams
base = rss_mb()
llm = LLM(sys.argv[1], kv_cache_memory="32MiB", max_model_len=256)
llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
print(json.dumps({"base_mb": base, "peak_mb": rss_mb()}))
"""


@pytest.mark.parametrize("start", ["first", "second"])
def test_loading_costs_about_the_file(smol_path, cache_dir, start):
    """Peak resident memory of loading and running a GGUF, in a fresh process, over what the runtime itself holds:
    at most 1.25x the file + the KV cache + 300 MB (a float32 copy of the quantized linears alone would be ~6x the
    file), on the first start (packing) and on the second (mapping the cache)."""
    env = {**os.environ, "PAGEMILL_RECORDS_CACHE_DIR": str(cache_dir)}
    runs = 2 if start == "second" else 1
    for _ in range(runs):
        proc = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, smol_path], capture_output=True, text=True,
                              env=env, timeout=300, cwd=str(Path(__file__).resolve().parents[2]))
        assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    file_mb = os.path.getsize(smol_path) / 2**20
    added = result["peak_mb"] - result["base_mb"]
    assert added <= 1.25 * file_mb + 32 + 300, (result, file_mb)


def test_load_log_reports_weight_bytes_and_resident_memory(smol_path, cache_dir, caplog):
    """The load log says what the weights cost by how they are held, and the resident set after load."""
    import logging

    from pagemill.layers.quantization.weight_memory import weight_bytes_by_kind

    with caplog.at_level(logging.INFO, logger="pagemill.loader.model_loader"):
        llm = _start(smol_path)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Loaded "))
    assert "weights: records 0.10 GB" in line and "; resident " in line
    kinds = weight_bytes_by_kind(llm.llm_engine.engine_core.executor.model_runner.model)
    file_bytes = os.path.getsize(smol_path)
    # records + float about the file, no float copy (the file blocks are views of the file's map: a tied
    # embedding's rows, read in place as tokens are looked up)
    assert 0.8 * file_bytes <= kinds["records"] + kinds["float"] <= 1.1 * file_bytes, kinds
    assert kinds["file blocks"] > 0


def test_released_mapped_pages_leave_the_resident_set_and_read_back(tmp_path):
    """release_mapped_pages on a tensor viewing a safetensors file's map: RSS falls by about its size, and reading
    it again gives the same values (the pages come back from the file)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from pagemill.utils.memory import release_mapped_pages, resident_bytes

    path = tmp_path / "t.safetensors"
    save_file({"t": torch.arange(16 * 2**20, dtype=torch.int32)}, str(path))  # 64 MiB
    t = safe_open(str(path), framework="pt").get_tensor("t")
    want = int(t.sum())
    before = resident_bytes()
    assert release_mapped_pages(t)
    assert resident_bytes() < before - 48 * 2**20
    assert int(t.sum()) == want


def test_a_failed_write_is_not_fatal(smol_path, cache_dir, monkeypatch, caplog):
    """A full disk fails safetensors' write with its own error (not an OSError): the start goes on, nothing is
    left half written, and the next start packs again."""
    from safetensors import SafetensorError

    import pagemill.layers.quantization.records_cache as records_cache

    def disk_full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(records_cache, "save_file", disk_full)
    llm = _start(smol_path)
    assert _tokens(llm)
    assert "Could not write the records cache" in caplog.text
    assert not cache_dir.exists() or not list(cache_dir.iterdir())


def test_the_directory_keeps_under_its_limit(smol_path, cache_dir, tmp_path, monkeypatch):
    """Beyond PAGEMILL_RECORDS_CACHE_MAX_GB a write removes the least recently used records (another file's), never
    the records the start just wrote."""
    monkeypatch.setenv("PAGEMILL_RECORDS_CACHE_MAX_GB", "0.15")  # one SmolLM2's records and head screen (~134 MB)
    first, second = tmp_path / "first.gguf", tmp_path / "second.gguf"
    shutil.copyfile(smol_path, first)
    shutil.copyfile(smol_path, second)
    _close(_start(str(first)))
    (first_records,) = _cache_files(cache_dir)
    _close(_start(str(second)))
    (second_records,) = _cache_files(cache_dir)
    assert second_records != first_records and not first_records.exists()
    assert sum(p.stat().st_size for p in cache_dir.iterdir()) <= 0.15 * 2**30
