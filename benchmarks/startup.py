"""Start-up cost: `LLM()` load time per phase and peak RSS, and `pagemill serve` time to /health, in fresh processes.

    python benchmarks/startup.py                      # default model, 3 runs of each, min and median
    python benchmarks/startup.py --runs 5 --save-result results/startup.json
    python benchmarks/startup.py --skip-serve --engine-arg kv_cache_memory=512MiB

Each `LLM()` run is a new Python process (cold imports, warm page cache: the GGUF has been read before), so the
numbers are what a user sees on a second start. Peak RSS is the process's own high-water mark (VmHWM: ru_maxrss
would carry over the parent's); for `serve`, that of the HTTP front end and of the engine core process. Machines shared with other jobs are
noisy: the load average is printed with the results, and min-of-runs is the number to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

# Runs in the child: times each load phase by wrapping the functions that do it.
_LLM_CHILD = r"""
import functools, json, resource, sys, time
t0 = time.perf_counter()
import pagemill
from pagemill import LLM
import pagemill.engine.llm_engine as le, pagemill.engine.arg_utils as mf, pagemill.worker.model_runner as mr
import pagemill.models.weights as mw
phases = {"import": time.perf_counter() - t0}
def timed(mod, name, label):
    f = getattr(mod, name)
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            phases[label] = phases.get(label, 0.0) + time.perf_counter() - t
    setattr(mod, name, g)
timed(mf, "resolve_model", "config")
timed(le, "load_engine_tokenizer", "tokenizer")
timed(mr, "load_model", "model")
timed(mw, "process_weights_after_loading", "linear_packing")
t1 = time.perf_counter()
llm = LLM(**json.loads(sys.argv[1]))
phases["LLM()"] = time.perf_counter() - t1
phases["weights"] = phases["model"] - phases.get("linear_packing", 0.0)
phases["kv_cache_and_rest"] = phases["LLM()"] - phases["config"] - phases["tokenizer"] - phases["model"]
phases["total"] = time.perf_counter() - t0
hwm = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")]  # ru_maxrss would include
peak = hwm[0] / 1024 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the parent's
print("RESULT " + json.dumps({"phases": phases, "peak_rss_mb": peak}))
"""


def _engine_arg_value(text: str) -> object:
    """An --engine-arg value: JSON where it parses (2048, true, 0.5), else the string (512MiB)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def run_llm_once(engine_args: dict) -> dict:
    """One `LLM(**engine_args)` in a fresh interpreter: phase times (s) and peak RSS (MB)."""
    out = subprocess.run([sys.executable, "-c", _LLM_CHILD, json.dumps(engine_args)], capture_output=True,
                         text=True, timeout=600)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"LLM() run failed:\n{out.stderr[-3000:]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return kids


def _vm_hwm_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _serve_command() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "pagemill")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "pagemill.entrypoints.cli"]


def run_serve_once(serve_args: list[str], timeout_s: float = 300.0) -> dict:
    """Start `pagemill serve`, poll /health every 50 ms: seconds from process start to the first 200, and memory."""
    port = _free_port()
    cmd = _serve_command() + ["serve", "--port", str(port), "--disable-uvicorn-access-log", *serve_args]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while time.perf_counter() - start < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"pagemill serve exited with {proc.returncode}:\n{proc.stderr.read()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        elapsed = time.perf_counter() - start
                        break
            except OSError:
                pass
            time.sleep(0.05)
        else:
            raise RuntimeError(f"pagemill serve: no /health after {timeout_s:.0f} s")
        rss = {"front_end": _vm_hwm_mb(proc.pid)}
        for i, kid in enumerate(_children(proc.pid)):
            rss[f"child_{i}"] = _vm_hwm_mb(kid)
        return {"time_to_health_s": elapsed, "peak_rss_mb": rss}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _summary(values: list[float]) -> str:
    return f"min {min(values):6.2f}  median {statistics.median(values):6.2f}"


def main(argv: list[str] | None = None) -> int:
    """Run the measurements and print min / median per phase."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="extra LLM() argument, e.g. kv_cache_memory=512MiB (repeatable)")
    ap.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                    help="extra `pagemill serve` argument, e.g. --serve-arg=--max-model-len=2048 (repeatable)")
    ap.add_argument("--skip-llm", action="store_true")
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("--save-result", default=None)
    args = ap.parse_args(argv)
    engine_args = {k: _engine_arg_value(v) for k, v in (a.split("=", 1) for a in args.engine_arg)}
    if args.model:
        engine_args["model"] = args.model
    result: dict = {"args": vars(args), "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                                                    "load_average_before": os.getloadavg()}}
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    if not args.skip_llm:
        runs = [run_llm_once(engine_args) for _ in range(args.runs)]
        result["llm"] = runs
        print(f"LLM({', '.join(f'{k}={v}' for k, v in engine_args.items())}), {args.runs} fresh processes (seconds):")
        for phase in runs[0]["phases"]:
            print(f"  {phase:18s} {_summary([r['phases'][phase] for r in runs])}")
        print(f"  {'peak RSS (MB)':18s} {_summary([r['peak_rss_mb'] for r in runs])}", flush=True)
    if not args.skip_serve:
        serve_args = list(args.serve_arg) + (["--model", args.model] if args.model else [])
        runs = [run_serve_once(serve_args) for _ in range(args.runs)]
        result["serve"] = runs
        print(f"pagemill serve {' '.join(serve_args)}: process start -> /health OK, {args.runs} runs (seconds):")
        print(f"  {'time to /health':18s} {_summary([r['time_to_health_s'] for r in runs])}")
        for proc in runs[0]["peak_rss_mb"]:
            print(f"  {'peak RSS ' + proc:18s} {_summary([r['peak_rss_mb'].get(proc, 0.0) for r in runs])} MB")
    result["machine"]["load_average_after"] = os.getloadavg()
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.save_result:
        os.makedirs(os.path.dirname(os.path.abspath(args.save_result)), exist_ok=True)
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
