"""Small-M linear layers on SmolLM2-135M's shapes: F.linear (fp32, fp16/mkldnn) vs pagemill's gemv kernels.

For each M (rows = decode batch) and method, prints the median (and best) time of one layer's 4 projections
+ the LM head ("layer+head", weights partly cache-resident) and of a whole token's worth (30 distinct layers
+ LM head, weights streamed from memory), with GFLOP/s and the effective GB/s of weight bytes read.
"gemv_q4 + i8 head" runs the layers as Q4_1 (gemv_q4; the random weights are not Q4_1, only the bytes streamed
matter here) and the LM head as int8 groups of 32 (gemv_int8), as for a GGUF Q4_1 model with a Q8_0 head.
"gguf <format>" runs every weight (head included) as the records GGUF's blocks of that format are kept as (random
blocks: only the bytes streamed matter): q4_0 / q4_1 nibble records, q5_0 / q5_1 5-bit records, q8_0 int8 tiles.
The K-quants need K % 256 == 0, which SmolLM2's 576 is not (tests/kernels/test_gguf_records.py covers them).

    python benchmarks/gemv.py [--ms 1,2,4,8,16] [--repeats 7] [--per-shape] [--threads N] [--methods q4,f16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

from pagemill.kernels.build import load_kernels

HIDDEN, LAYERS = 576, 30
# (name, N, K): fused qkv, o_proj, fused gate_up, down; then the LM head.
LAYER_SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)]
HEAD_SHAPE = ("lm_head", 49152, 576)


def _sample_ms(fn: Callable[[], None], min_time: float) -> float:
    """Mean wall time of fn() in ms over a loop of at least min_time seconds."""
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= min_time:
            return dt / n * 1e3


class Method:
    """One way to run y = x W^T + b: prepares each weight once, then calls on (x, prepared weight).

    The LM head may use another way (head: a Method of its own)."""

    def __init__(self, name: str, prepare: Callable, call: Callable, bytes_per_weight: float,
                 head: Method | None = None) -> None:
        self.name, self.prepare, self.call, self.bytes_per_weight = name, prepare, call, bytes_per_weight
        self.head = head or self

    def bytes(self, layer_params: int, head_params: int) -> float:
        return layer_params * self.bytes_per_weight + head_params * self.head.bytes_per_weight


def _methods(k) -> list[Method]:
    ms = [
        Method("F.linear fp32", lambda w: w, lambda x, w, n: F.linear(x, w), 4),
        Method("F.linear fp16", lambda w: w.half(), lambda x, w, n: F.linear(x.half(), w), 2),
    ]
    if k is None:
        return ms

    def f16(x, p, n):
        out = torch.empty(x.shape[0], n)
        k.gemv_f16(out, x, p, None)

    def i8(x, p, n):
        out = torch.empty(x.shape[0], n)
        k.gemv_int8(out, x, p[0], p[1], None)

    def q4(x, p, n):
        out = torch.empty(x.shape[0], n)
        k.gemv_q4(out, x, p, None)

    ms.append(Method("gemv_f16", k.pack_gemv_weight_f16, f16, 2))
    ms.append(Method("gemv_int8 g128", lambda w: k.pack_gemv_weight_int8(w, 128), i8, 1 + 4 / 128))
    ms.append(Method("gemv_int8 per-ch", lambda w: k.pack_gemv_weight_int8(w, w.shape[1]), i8, 1 + 4 / 576))
    i8_g32 = Method("gemv_int8 g32", lambda w: k.pack_gemv_weight_int8(w, 32), i8, 1 + 4 / 32)
    ms.append(Method("gemv_q4 + i8 head", lambda w: k.pack_gemv_weight_q4(w, 32)[0], q4, 0.5 + 4 / 32, i8_g32))
    for fmt, bpw in (("q4_0", 0.625), ("q5_0", 0.75), ("q5_1", 0.75), ("q8_0", 1.125)):
        ms.append(Method(f"gguf {fmt}", lambda w, fmt=fmt: _gguf_records(fmt, w), _gguf_call(k), bpw))
    return ms


def _gguf_records(fmt: str, w: torch.Tensor) -> tuple[str, object]:
    """(record kind, records) of random valid GGUF blocks of w's shape in `fmt` (32-element blocks)."""
    from pagemill.layers.quantization.gguf import pack_records

    n, kk = w.shape
    nbytes = {"q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "q8_0": 34}[fmt]
    blocks = torch.randint(0, 256, (n, kk // 32, nbytes), dtype=torch.uint8)
    halves = 2 if fmt in ("q4_1", "q5_1") else 1  # d (and m): small fp16 values
    blocks[..., :2 * halves] = (torch.rand(n, kk // 32, halves) * 1e-3).half().view(torch.uint8).view(n, kk // 32, -1)
    return pack_records([(fmt, blocks)])


def _gguf_call(k) -> Callable:
    from pagemill.layers.quantization.gguf_records import PLANE_LAYOUTS

    def call(x, p, n):
        kind, rec = p
        out = torch.empty(x.shape[0], n)
        if kind == "int8":
            k.gemv_int8(out, x, rec[0], rec[1], None, rec[2] if len(rec) > 2 else None)
        else:
            k.gemv_records(out, x, rec, PLANE_LAYOUTS[kind][3], None)

    return call


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,2,4,8,16", help="row counts M")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--per-shape", action="store_true", help="also time each shape alone")
    ap.add_argument("--threads", type=int, default=0, help="torch/OpenMP threads (default: torch's)")
    ap.add_argument("--methods", default="", help="comma-separated substrings: time only the methods matching one "
                    "(F.linear fp32, the baseline, always runs)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    kernels = load_kernels()
    if kernels is None:
        print("pagemill kernels unavailable: only F.linear is timed", file=sys.stderr)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    methods = _methods(kernels)
    if args.methods:
        keys = args.methods.split(",")
        methods = [m for m in methods if m.name == "F.linear fp32" or any(key in m.name for key in keys)]
    layers = [[torch.randn(n, kk) * 0.02 for _, n, kk in LAYER_SHAPES] for _ in range(LAYERS)]
    head = torch.randn(HEAD_SHAPE[1], HEAD_SHAPE[2]) * 0.02
    params_layer = sum(n * kk for _, n, kk in LAYER_SHAPES)
    params_head = HEAD_SHAPE[1] * HEAD_SHAPE[2]
    ms_list = [int(m) for m in args.ms.split(",")]
    # Every method's weights stay resident, and the samples of the methods are interleaved, so that load
    # from other processes on this shared box hits all of them alike.
    prepared = [([[meth.prepare(w) for w in ws] for ws in layers], meth.head.prepare(head)) for meth in methods]
    del layers, head
    samples: dict[tuple[str, int, str], list[float]] = {}
    with torch.inference_mode():
        for m in ms_list:
            x = torch.randn(m, HIDDEN)
            xs = [x, x, x, torch.randn(m, 1536)]
            cases: dict[str, list[Callable[[], None]]] = {"layer+head": [], "token": []}
            for meth, (pl, ph) in zip(methods, prepared):
                def layer(i: int, meth=meth, pl=pl) -> None:
                    for (_, n, _), w, xi in zip(LAYER_SHAPES, pl[i], xs):
                        meth.call(xi, w, n)

                def head_call(meth=meth, ph=ph) -> None:
                    meth.head.call(x, ph, HEAD_SHAPE[1])

                cases["layer+head"].append(lambda layer=layer, head_call=head_call: (layer(0), head_call()))
                cases["token"].append(
                    lambda layer=layer, head_call=head_call: ([layer(i) for i in range(LAYERS)], head_call()))
                if args.per_shape:
                    for (name, n, kk), w, xi, call in zip(LAYER_SHAPES + [HEAD_SHAPE], pl[0] + [ph], xs + [x],
                                                          [meth.call] * len(LAYER_SHAPES) + [meth.head.call]):
                        cases.setdefault(name, []).append(lambda call=call, xi=xi, w=w, n=n: call(xi, w, n))
            for what, fns in cases.items():
                min_time = 0.2 if what == "token" else 0.05
                for fn in fns:  # warm-up
                    fn()
                    fn()
                for _ in range(args.repeats):
                    for meth, fn in zip(methods, fns):
                        samples.setdefault((meth.name, m, what), []).append(_sample_ms(fn, min_time))

    # (what, layer weights, head weights)
    shapes = [("layer+head", params_layer, params_head), ("token", LAYERS * params_layer, params_head)]
    if args.per_shape:
        shapes += [(name, n * kk, 0) for name, n, kk in LAYER_SHAPES] + [(HEAD_SHAPE[0], 0, params_head)]
    for what, layer_params, head_params in shapes:
        params = layer_params + head_params
        print(f"\n== {what} ({params / 1e6:.1f} M weights) ==")
        print(f"{'M':>3} {'method':<18} {'ms':>8} {'best ms':>8} {'GFLOP/s':>8} {'GB/s':>7} {'vs fp32':>8}")
        for m in ms_list:
            base = statistics.median(samples[("F.linear fp32", m, what)])
            for meth in methods:
                ts = samples[(meth.name, m, what)]
                t = statistics.median(ts)
                gflops = 2 * m * params / (t * 1e-3) / 1e9
                gbs = meth.bytes(layer_params, head_params) / (t * 1e-3) / 1e9
                print(f"{m:>3} {meth.name:<18} {t:>8.3f} {min(ts):>8.3f} {gflops:>8.1f} {gbs:>7.1f} "
                      f"{base / t:>7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
