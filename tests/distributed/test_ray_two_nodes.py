"""Two real Ray nodes: a head and a worker node, each in its own network namespace joined by a veth pair with private
addresses (Ray advertises an interface address, not loopback, and refuses a second node forced onto 127.0.0.1).
A TP=2 engine with the `ray` executor runs one rank on each node and gives the single-process engine's greedy tokens.

Nothing outside the two namespaces is contacted. Teardown ends exactly the processes that live in the namespaces
(`ray stop` would kill every Ray process on the host by name, other tests' clusters included), then deletes them.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pagemill import LLM, SamplingParams

pytest.importorskip("ray", reason="ray is not installed (pip install ray)")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
MAX_TOKENS = 10
GCS_PORT = 6379  # each namespace has its own ports: no clash with a Ray cluster on the host
REPO = Path(__file__).resolve().parents[2]
RAY = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


def _ns_pids(ns: str) -> list[int]:
    res = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10)
    return [int(p) for p in res.stdout.split()]


def _end_namespace_processes(namespaces: list[str], grace_s: float = 3.0) -> None:
    """SIGTERM every process in the namespaces (all started by this test), SIGKILL what is left after `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        for pid in (pid for ns in namespaces for pid in _ns_pids(ns)):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while any(_ns_pids(ns) for ns in namespaces) and time.monotonic() < deadline:
            time.sleep(0.1)


class TwoNamespaces:
    """A head and a worker namespace, `pm0` in each, 10.213.<n>.1/30 and .2/30."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.head, self.worker = f"pmrh{tag}", f"pmrw{tag}"
        subnet = os.getpid() % 250
        self.head_ip, self.worker_ip = f"10.213.{subnet}.1", f"10.213.{subnet}.2"
        self.created: list[str] = []

    def create(self) -> None:
        """The namespaces, the veth pair, addresses, links up (CalledProcessError if `ip` refuses)."""
        a, b = f"pmva{os.getpid() % 100000}", f"pmvb{os.getpid() % 100000}"
        for ns in (self.head, self.worker):
            _ip("netns", "add", ns)
            self.created.append(ns)
        _ip("link", "add", a, "type", "veth", "peer", "name", b)
        for dev, ns, addr in ((a, self.head, self.head_ip), (b, self.worker, self.worker_ip)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "link", "set", dev, "name", "pm0")
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", "pm0")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", "pm0", "up")

    def destroy(self) -> None:
        """End the processes inside, delete the namespaces (the veth pair goes with them)."""
        _end_namespace_processes(self.created)
        for ns in self.created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        self.created.clear()


def _wait_for_port(ns: str, ip: str, port: int, timeout_s: float) -> None:
    probe = f"import socket; socket.create_connection(({ip!r}, {port}), 0.5).close()"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-c", probe]
        if subprocess.run(cmd, capture_output=True).returncode == 0:
            return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {ip}:{port} in {ns} after {timeout_s:.0f} s")


@pytest.fixture
def two_node_cluster() -> Iterator[tuple[TwoNamespaces, dict[str, str]]]:
    """A head node and a worker node (1 CPU each) in their own namespaces; the environment that reaches them."""
    if RAY is None:
        pytest.skip("the `ray` command is not installed")
    nets = TwoNamespaces()
    try:
        nets.create()
    except (OSError, subprocess.CalledProcessError) as e:
        nets.destroy()
        detail = e.stderr.strip() if isinstance(e, subprocess.CalledProcessError) else str(e)
        pytest.skip(f"cannot create network namespaces here (needs root and `ip netns`): {detail}")
    tmp: list[str] = []
    logs: list[Any] = []
    try:
        tmp = [tempfile.mkdtemp(prefix="pmray") for _ in range(2)]  # short: Ray's socket paths live under it
        env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
                   RAY_ADDRESS=f"{nets.head_ip}:{GCS_PORT}", RAY_USAGE_STATS_ENABLED="0",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        env.pop("GLOO_SOCKET_IFNAME", None)
        # The two "nodes" share this host's /dev/shm, which real nodes do not: keep the collectives on the network.
        env["PAGEMILL_CPU_SHM_ALLREDUCE"] = "0"
        env["PM_RAY_LOGS"] = os.pathsep.join(os.path.join(t, "ray_start.log") for t in tmp)
        common = ["--block", "--num-cpus=1", "--disable-usage-stats"]
        logs = [open(os.path.join(t, "ray_start.log"), "w") for t in tmp]
        subprocess.Popen(["ip", "netns", "exec", nets.head, RAY, "start", "--head", f"--port={GCS_PORT}",
                          f"--node-ip-address={nets.head_ip}", "--include-dashboard=false", f"--temp-dir={tmp[0]}",
                          *common], env=env, stdout=logs[0], stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_for_port(nets.head, nets.head_ip, GCS_PORT, 60)
        except TimeoutError as e:
            raise TimeoutError(f"{e}; the head's log:{_logs(env)}") from None
        subprocess.Popen(["ip", "netns", "exec", nets.worker, RAY, "start", f"--address={nets.head_ip}:{GCS_PORT}",
                          f"--node-ip-address={nets.worker_ip}", f"--temp-dir={tmp[1]}", *common], env=env,
                         stdout=logs[1], stderr=subprocess.STDOUT, start_new_session=True)
        yield nets, env  # the executor's placement group waits for the worker node to join
    finally:
        nets.destroy()
        for f in logs:
            f.close()
        for t in tmp:
            shutil.rmtree(t, ignore_errors=True)


def _logs(env: dict[str, str]) -> str:
    return "".join(f"\n--- {p}:\n" + p.read_text()[-2000:] for p in map(Path, env["PM_RAY_LOGS"].split(os.pathsep)))


@pytest.mark.slow  # ~30-45 s on 2 cores: two Ray nodes start, two actors load the model
def test_ray_tp2_across_two_nodes_matches_single_process(two_node_cluster, tiny_llama):
    nets, env = two_node_cluster
    res = subprocess.run(["ip", "netns", "exec", nets.head, sys.executable,
                          str(Path(__file__).with_name("ray_two_node_driver.py")), tiny_llama, str(MAX_TOKENS),
                          json.dumps(PROMPTS)], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:] + _logs(env)
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert sorted(got["node_ips"]) == [nets.head_ip, nets.worker_ip]  # one rank on each node
    want = LLM(tiny_llama, kv_cache_memory="8MiB", max_model_len=256).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=True), use_tqdm=False)
    for toks, lps, w in zip(got["token_ids"], got["logprobs"], want):
        assert toks == w.outputs[0].token_ids
        assert all(abs(lp - wl[t].logprob) < 1e-4 for lp, t, wl in zip(lps, toks, w.outputs[0].logprobs))
