"""Disaggregated prefill/decode vs colocated serving: TTFT, TPOT, ITL and throughput under one mixed load.

Starts a prefill server (kv_producer) and a decode server (kv_consumer) joined by a KV connector, the
`pagemill disagg-proxy` in front of them, and a colocated server with the threads of both; then runs
`pagemill bench serve` against the proxy with the colocated server as its side-by-side baseline.

    python benchmarks/pd_disagg.py --threads 2 --num-prompts 64 --request-rate 2 --save-result results/pd.json
    python benchmarks/pd_disagg.py --connector SharedStorageConnector ...   # KV through files in a temp dir

P and D get --threads // 2 threads each (at least 1), so both layouts use the same cores. Extra flags after `--`
go to `pagemill bench serve` (e.g. -- --dataset-name random --random-input-len 512 --random-output-len 64).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from pagemill.benchmarks.llama_cpp import free_port, wait_http_ready


def cli(*args: str) -> list[str]:
    """A `pagemill` command line run with this interpreter."""
    return [sys.executable, "-m", "pagemill.entrypoints.cli", *args]


def main(argv: list[str] | None = None) -> None:
    """Start the servers, run the benchmark, stop everything."""
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="cores of the colocated server")
    p.add_argument("--connector", default="ZmqConnector", choices=("ZmqConnector", "SharedStorageConnector"))
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dataset-name", default="sharegpt")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", default="2")
    p.add_argument("--save-result", default=None)
    args = p.parse_args(argv)

    model = [args.model] if args.model else []
    common = [*model, "--kv-cache-memory", args.kv_cache_memory, "--max-model-len", str(args.max_model_len),
              "--disable-uvicorn-access-log"]
    half = str(max(1, args.threads // 2))
    storage = tempfile.mkdtemp(prefix="pagemill_pd_")
    kv = {"kv_connector": args.connector, "kv_port": free_port(),
          "kv_connector_extra_config": {"shared_storage_path": storage}}
    ports = {name: free_port() for name in ("prefill", "decode", "proxy", "colocated")}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    procs = {
        "prefill": cli("serve", *common, "--port", str(ports["prefill"]), "--num-threads", half,
                       "--kv-transfer-config", json.dumps({**kv, "kv_role": "kv_producer"})),
        "decode": cli("serve", *common, "--port", str(ports["decode"]), "--num-threads", half,
                      "--kv-transfer-config", json.dumps({**kv, "kv_role": "kv_consumer"})),
        "colocated": cli("serve", *common, "--port", str(ports["colocated"]), "--num-threads", str(args.threads)),
        "proxy": cli("disagg-proxy", "--prefill", url["prefill"], "--decode", url["decode"],
                     "--port", str(ports["proxy"])),
    }
    running: dict[str, subprocess.Popen] = {}
    try:
        for name, cmd in procs.items():
            running[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL if name == "proxy" else None)
        for name, proc in running.items():
            wait_http_ready(url[name] + "/health", proc, 300.0, name)
        bench = cli("bench", "serve", "--base-url", url["proxy"], "--label", f"P/D ({args.connector})",
                    "--baseline-base-url", url["colocated"], "--baseline-label", "colocated",
                    "--dataset-name", args.dataset_name, "--num-prompts", str(args.num_prompts),
                    "--request-rate", args.request_rate,
                    *(["--save-result", args.save_result] if args.save_result else []), *extra)
        subprocess.run(bench, check=True)
    finally:
        for proc in running.values():
            proc.terminate()
        for proc in running.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
