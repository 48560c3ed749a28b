"""llama.cpp as a benchmark peer: find its binaries, build its command lines, parse llama-batched-bench,
and run llama-server as a subprocess.

The binaries come from `python benchmarks/peers/build_llama_cpp.py` (a native build of the llama.cpp tree
vendored in llama-cpp-python's sdist) in $PAGEMILL_PEERS_DIR/llama.cpp-VERSION/build/bin
(default ~/.cache/pagemill/peers). $PAGEMILL_LLAMA_CPP_BIN overrides the directory.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

VERSION = "0.3.36"  # llama-cpp-python sdist version; keep in step with benchmarks/peers/build_llama_cpp.py
BUILD_COMMAND = "python benchmarks/peers/build_llama_cpp.py"
BINARIES = ("llama-server", "llama-bench", "llama-batched-bench")


class LlamaCppNotFound(FileNotFoundError):
    """The llama.cpp peer binaries are not built."""


def peers_dir() -> Path:
    """Root of the peers cache: $PAGEMILL_PEERS_DIR or ~/.cache/pagemill/peers."""
    env = os.environ.get("PAGEMILL_PEERS_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagemill" / "peers"


def bin_dir() -> Path:
    """Directory holding the llama.cpp binaries ($PAGEMILL_LLAMA_CPP_BIN overrides the cache build)."""
    env = os.environ.get("PAGEMILL_LLAMA_CPP_BIN")
    if env:
        return Path(env).expanduser()
    return peers_dir() / f"llama.cpp-{VERSION}" / "build" / "bin"


def find_binary(name: str) -> str:
    """Path of one llama.cpp binary; raises LlamaCppNotFound naming the build command when absent."""
    if name not in BINARIES:
        raise ValueError(f"unknown llama.cpp binary {name!r}; expected one of {BINARIES}")
    path = bin_dir() / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise LlamaCppNotFound(
            f"llama.cpp peer binary {name} not found at {path}. Build it once (about 6 min on 2 cores) "
            f"with `{BUILD_COMMAND}` from the repository root (set PAGEMILL_PEERS_DIR to build elsewhere).")
    return str(path)


def binaries_available() -> bool:
    """True when every peer binary is built."""
    try:
        for name in BINARIES:
            find_binary(name)
    except LlamaCppNotFound:
        return False
    return True


# ---- llama-batched-bench -------------------------------------------------------------------------------

@dataclass(frozen=True)
class BatchedBenchRow:
    """One llama-batched-bench result: B sequences of PP prompt tokens, then TG decode steps of B tokens."""

    pp: int
    tg: int
    pl: int
    n_kv: int
    t_pp: float
    speed_pp: float
    t_tg: float
    speed_tg: float
    t: float
    speed: float


def batched_bench_ctx(pp: int, tg: int, pl: int) -> int:
    """A context size that fits `pl` sequences of `pp + tg` tokens (llama-batched-bench skips rows that don't)."""
    need = pl * (pp + tg)
    return max(256, -(-need // 256) * 256)


def batched_bench_command(binary: str, model: str, pp: int, tg: int, pl: int, threads: int,
                          warmup: bool = True) -> list[str]:
    """The llama-batched-bench command for one configuration, JSONL output.

    With `warmup`, a single-sequence row (same PP and TG) runs first in the same process, so the
    measured row (the last) runs warm, like pagemill's timed runs after its warm-up iterations.
    """
    npl = f"1,{pl}" if warmup else str(pl)
    return [binary, "-m", model, "-c", str(batched_bench_ctx(pp, tg, pl)), "-b", "2048", "-ub", "512",
            "-npp", str(pp), "-ntg", str(tg), "-npl", npl, "-t", str(threads), "-tb", str(threads),
            "--output-format", "jsonl"]


_NUM = r"[-+]?(?:nan|inf|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)"


def _float(text: str) -> float:
    text = text.strip().lower()
    return math.nan if "nan" in text else float(text)


def parse_batched_bench(text: str) -> list[BatchedBenchRow]:
    """Rows of llama-batched-bench output, JSONL (`--output-format jsonl`) or its Markdown table."""
    rows: list[BatchedBenchRow] = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"pp"' in line:
            fixed = re.sub(r":\s*(-?nan|-?inf)\b", lambda m: f': "{m.group(1)}"', line)
            d: dict[str, Any] = json.loads(fixed)
            rows.append(BatchedBenchRow(int(d["pp"]), int(d["tg"]), int(d["pl"]), int(d["n_kv"]),
                                        _float(str(d["t_pp"])), _float(str(d["speed_pp"])),
                                        _float(str(d["t_tg"])), _float(str(d["speed_tg"])),
                                        _float(str(d["t"])), _float(str(d["speed"]))))
            continue
        cells = [c.strip() for c in line.strip("|").split("|")] if line.startswith("|") else []
        if len(cells) == 10 and all(re.fullmatch(_NUM, c, re.IGNORECASE) for c in cells):
            ints = [int(c) for c in cells[:4]]
            floats = [_float(c) for c in cells[4:]]
            rows.append(BatchedBenchRow(*ints, *floats))
    return rows


def run_batched_bench(model: str, pp: int, tg: int, pl: int, threads: int,
                      warmup: bool = True) -> BatchedBenchRow:
    """Run llama-batched-bench once (one process) and return the measured row; raises with its log on failure."""
    cmd = batched_bench_command(find_binary("llama-batched-bench"), model, pp, tg, pl, threads, warmup)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    rows = parse_batched_bench(proc.stdout + "\n" + proc.stderr)
    if proc.returncode != 0 or len(rows) != (2 if warmup else 1):
        raise RuntimeError(f"llama-batched-bench failed (exit {proc.returncode}, {len(rows)} rows): "
                           f"{' '.join(cmd)}\n{(proc.stderr or proc.stdout)[-3000:]}")
    return rows[-1]


# ---- llama-server --------------------------------------------------------------------------------------

def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_ctx(per_slot: int, parallel: int) -> int:
    """Total `-c` for `parallel` slots of at least `per_slot` tokens each (per slot rounded up to 256)."""
    slot = max(256, -(-per_slot // 256) * 256)
    return slot * parallel


def server_command(binary: str, model: str, port: int, threads: int, parallel: int, per_slot_ctx: int,
                   alias: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    """The llama-server command: `parallel` slots of `per_slot_ctx` tokens, `threads` threads, 127.0.0.1:port."""
    cmd = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-np", str(parallel), "-c", str(server_ctx(per_slot_ctx, parallel)),
           "-b", "2048", "-ub", "512", "--no-webui"]
    if alias:
        cmd += ["--alias", alias]
    return cmd + list(extra)


def wait_http_ready(url: str, proc: subprocess.Popen | None, timeout_s: float, what: str) -> None:
    """Poll `url` until it answers 200; fail early if `proc` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{what} did not answer {url} within {timeout_s:.0f} s")


class ManagedServer:
    """A server subprocess (llama-server or `pagemill serve`) that is ready once `start()` returns."""

    def __init__(self, cmd: Sequence[str], port: int, what: str, log_path: str | None = None,
                 ready_path: str = "/health", timeout_s: float = 300.0) -> None:
        self.cmd = list(cmd)
        self.port = port
        self.what = what
        self.log_path = log_path or os.path.join("/tmp", f"pagemill-peer-{what.replace(' ', '_')}-{port}.log")
        self.ready_path = ready_path
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        """http://127.0.0.1:PORT."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ManagedServer":
        """Start the process and wait until it serves; its output goes to `log_path`."""
        log = open(self.log_path, "w", encoding="utf-8")  # noqa: SIM115 - kept open for the child
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        try:
            wait_http_ready(self.base_url + self.ready_path, self.proc, self.timeout_s, self.what)
        except BaseException as e:
            self.stop()
            tail = Path(self.log_path).read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{e}\ncommand: {' '.join(self.cmd)}\nlog tail ({self.log_path}):\n{tail}") from None
        return self

    def stop(self) -> None:
        """Terminate the process (kill after 20 s)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "ManagedServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def llama_server(model: str, threads: int, parallel: int, per_slot_ctx: int, alias: str | None = None,
                 extra: Sequence[str] = ()) -> ManagedServer:
    """A (not yet started) llama-server on a free 127.0.0.1 port."""
    port = free_port()
    cmd = server_command(find_binary("llama-server"), model, port, threads, parallel, per_slot_ctx, alias, extra)
    return ManagedServer(cmd, port, "llama-server")
