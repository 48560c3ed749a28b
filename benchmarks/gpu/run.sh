#!/usr/bin/env bash
# The one script a GPU session runs (<= 8 minutes on an H100 / H200), from the repository root of the carried tree:
#
#   bash benchmarks/gpu/run.sh              # on the GPU machine (carry benchmarks/gpu/wheels)
#   bash benchmarks/gpu/run.sh --dry-run    # rehearsal on a CPU: the same steps, tiny, through Triton's interpreter
#   bash benchmarks/gpu/run.sh --fetch-wheels   # on a CPU machine with network: the cp312 wheels the GPU lacks
#
# Steps: install pagemill --no-deps (+ the carried wheels: msgspec, pyzmq, gguf), environment, the CUDA tests
# (Triton kernels compiled on the GPU against the torch reference; tests/cuda), parity vs HF transformers on CUDA
# (fp32 greedy in every scheduler path, bf16 top-1), the throughput benchmark (Llama-3.2-1B shape, nano-vllm's
# workload, HF generate on a subset), and one table last. Without CUDA (and without --dry-run) it skips at once.
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/pagemill-gpu}    # logs and result JSON only (the device tool sends $OUT back)
WORK=${WORK:-/tmp/pagemill-gpu-work}  # installed packages and the built models (gigabytes): never under $OUT
WHEELS=benchmarks/gpu/wheels
DRY=0
ONLY=tests,parity,throughput,single,serve   # --only=parity,single: a subset (e.g. two calls of < 10 minutes each)
for arg in "$@"; do
  case $arg in
    --dry-run) DRY=1 ;;
    --only=*) ONLY=${arg#--only=} ;;
    --fetch-wheels)
      mkdir -p $WHEELS
      $PY -m pip download -q --no-deps --only-binary :all: --python-version 3.12 --implementation cp --abi cp312 \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        msgspec==0.22.0 pyzmq==27.3.0 pydantic-core==2.50.5 -d $WHEELS \
        && $PY -m pip download -q --no-deps gguf==0.19.0 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 \
        annotated-types==0.8.0 typing-inspection==0.4.5 uvicorn==0.54.0 \
        opentelemetry-api==1.45.2 typing-extensions==4.16.0 annotated-doc==0.0.7 -d $WHEELS
      ls -la $WHEELS; exit $? ;;
    *) echo "unknown argument $arg"; exit 2 ;;
  esac
done
mkdir -p "$OUT" "$WORK"
TM=1; [ $DRY = 1 ] && TM=8   # the interpreter on a shared CPU is slow: longer stage limits in a rehearsal
START=$(date +%s)
stage() { echo; echo "=== $1 ($(( $(date +%s) - START ))s)"; }
declare -A STATUS

if [ $DRY = 0 ] && ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "SKIP: no CUDA device visible to torch (use --dry-run to rehearse on the CPU)"; exit 0
fi

stage "install"
if [ $DRY = 0 ]; then
  # into a target directory: works where the system Python is externally managed (PEP 668) and leaves it untouched
  SITE="$WORK/site"; rm -rf "$SITE"; mkdir -p "$SITE"
  if ls $WHEELS/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-deps --no-index --target "$SITE" $WHEELS/*.whl || echo "WARN: carried wheels did not install"
  else
    echo "WARN: no carried wheels in $WHEELS (msgspec, pyzmq, gguf): run --fetch-wheels on a CPU machine and carry it"
  fi
  if $PY -m pip install -q --no-deps --no-build-isolation --no-index --target "$SITE" . 2>"$OUT/pip.log"; then
    echo "pagemill installed (pip --no-deps --target $SITE)"; export PYTHONPATH="$SITE"
  else
    echo "pip install of pagemill failed (see $OUT/pip.log): using the tree"; export PYTHONPATH="$ROOT:$SITE"
  fi
else
  export PYTHONPATH=$ROOT TRITON_INTERPRET=1
fi
cd "$WORK"  # (an installed pagemill, not the tree's, unless PYTHONPATH says so)
$PY -c "import pagemill, sys; print('pagemill from', pagemill.__file__)" || { echo "FAIL: import pagemill"; exit 1; }

stage "environment"
$PY - <<'PYEOF'
import torch, triton, transformers
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, transformers {transformers.__version__}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU {p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}, {torch.cuda.device_count()} device(s)")
from pagemill.platforms import current_platform
print("platform", current_platform, "worker", current_platform.worker_cls)
PYEOF
[ $DRY = 0 ] && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

want() { [[ ",$ONLY," == *",$1,"* ]]; }
STATUS[tests]=skipped; STATUS[parity]=skipped; STATUS[throughput]=skipped; STATUS[single]=skipped; STATUS[serve]=skipped
if want tests; then
stage "CUDA tests (Triton kernels compiled on the GPU vs the torch reference; tests/cuda)"
if [ $DRY = 0 ]; then KERNEL_ENV="TRITON_INTERPRET=0"
  KERNEL_TESTS="$ROOT/tests/attention/test_triton_paged.py $ROOT/tests/kernels/test_triton_ops.py"
else KERNEL_ENV="TRITON_INTERPRET=1"; KERNEL_TESTS="$ROOT/tests/kernels/test_triton_ops.py -k rotary"; fi
# the kernel tests mostly compile (one Triton build per shape): in 8 processes where pytest-xdist is installed (the
# GPU image has it); tests/cuda (engines sized from gpu_memory_utilization) after them, in one process
XDIST=""; $PY -c "import xdist" 2>/dev/null && [ $DRY = 0 ] && XDIST="-n 8"
(cd "$ROOT" && env $KERNEL_ENV timeout $((${T_TESTS:-150} * TM)) bash -c \
  "$PY -m pytest $KERNEL_TESTS $XDIST -q -p no:cacheprovider; k=\$?; $PY -m pytest $ROOT/tests/cuda -q -p no:cacheprovider; \
   c=\$?; exit \$(( k | c ))" 2>&1 | tee "$OUT/tests.log" | tail -25; exit ${PIPESTATUS[0]})
STATUS[tests]=$?
fi

if want parity; then
stage "parity vs HF transformers"
rm -f "$OUT/parity.log"
timeout $((${T_PARITY:-140} * TM)) $PY "$ROOT/benchmarks/gpu/parity.py" $([ $DRY = 1 ] && echo --dry-run) --root "$WORK/models" 2>&1 \
  | tee "$OUT/parity.log" | grep -v -i "warnings.warn\|futurewarning" | tail -40
STATUS[parity]=${PIPESTATUS[0]}
fi

if want throughput; then
stage "throughput (nano-vllm workload)"
rm -f "$OUT/throughput.json"
timeout $((${T_THROUGHPUT:-200} * TM)) $PY "$ROOT/benchmarks/gpu/throughput.py" $([ $DRY = 1 ] && echo --dry-run) \
  --root "$WORK/models" --async-too --virtual-too \
  $([ $DRY = 0 ] && echo --profile) \
  --json "$OUT/throughput.json" 2>&1 | tee "$OUT/throughput.log" | grep -v -i "warnings.warn\|futurewarning" | tail -20
STATUS[throughput]=${PIPESTATUS[0]}
fi

if want single; then
stage "single stream (Llama-3.1-8B shape, bf16, 128 in / 512 out)"
rm -f "$OUT/single.json"
timeout $((${T_SINGLE:-130} * TM)) $PY "$ROOT/benchmarks/gpu/single_stream.py" $([ $DRY = 1 ] && echo --dry-run) \
  --root "$WORK/models" --json "$OUT/single.json" 2>&1 | tee "$OUT/single.log" | grep -v -i "warnings.warn\|futurewarning" | tail -12
STATUS[single]=${PIPESTATUS[0]}
fi

if want serve; then
stage "serving (pagemill bench serve, ShareGPT-like lengths, Poisson arrivals, Llama-3.2-1B shape)"
rm -f "$OUT/serve.json"
timeout $((${T_SERVE:-150} * TM)) $PY "$ROOT/benchmarks/gpu/serve.py" $([ $DRY = 1 ] && echo --dry-run) \
  --root "$WORK/models" --json "$OUT/serve.json" 2>&1 | grep -v "Writing model\|Loading weights" \
  | tail -30
STATUS[serve]=${PIPESTATUS[0]}
fi

stage "summary"
$PY - "$OUT" "${STATUS[tests]}" "${STATUS[parity]}" "${STATUS[throughput]}" "${STATUS[single]}" "${STATUS[serve]}" <<'PYEOF'
import json, os, sys
out, tests, parity, thr, single, serve = sys.argv[1:]
def load(name):
    p = os.path.join(out, name)
    return json.load(open(p)) if os.path.exists(p) else {}
row, one, srv = load("throughput.json"), load("single.json"), load("serve.json")
par = next((l.strip() for l in open(os.path.join(out, "parity.log")) if l.startswith("PARITY")), "PARITY (no result)") \
    if os.path.exists(os.path.join(out, "parity.log")) else "PARITY (no result)"
def f(k, fmt="{:,.0f}"):
    return fmt.format(row[k]) if k in row else "-"
print("| check | result |")
print("|---|---|")
print(f"| card | {row.get('card', one.get('card', '-'))} |")
def status(rc):
    return {"0": "pass", "skipped": "skipped", "124": "TIMEOUT"}.get(rc, f"FAIL rc={rc}")
print(f"| CUDA tests | {status(tests)} |")
print(f"| parity | {status(parity)}: {par.removeprefix('PARITY ')} |")
print(f"| throughput run | {status(thr)} |")
print(f"| throughput, CUDA graphs (output tok/s) | {f('graphs_tok_s')} |")
print(f"| throughput, async scheduling (output tok/s) | {f('async_tok_s')} |")
print(f"| throughput, virtual KV (vTensor, CUDA VMM; output tok/s) | {f('virtual_tok_s')} |")
print(f"| roofline (tok/s) / pagemill's share | {f('roofline_tok_s')} / {f('pct_of_roofline', '{:.1%}')} |")
print(f"| HBM GB/s / bf16 GEMM TFLOP/s | {f('hbm_gb_s')} / {f('gemm_tflops')} |")
print(f"| HF generate subset (output tok/s) | {f('hf_tok_s')} |")
print(f"| workload | {row.get('num_seqs', '-')} seqs, {row.get('output_tokens', '-')} output tokens |")
print(f"| single stream run (8B shape) | {status(single)} |")
g = lambda k, fmt: fmt.format(one[k]) if k in one else "-"
print(f"| 8B TPOT, CUDA graphs / eager / graphs + async scheduling (ms) | {g('graphs_tpot_ms', '{:.2f}')} / "
      f"{g('eager_tpot_ms', '{:.2f}')} / {g('async_tpot_ms', '{:.2f}')} |")
print(f"| 8B HBM bound (ms) / share, graphs / eager / async | {g('bound_tpot_ms', '{:.2f}')} / "
      f"{g('graphs_pct_of_bound', '{:.1%}')} / {g('eager_pct_of_bound', '{:.1%}')} / "
      f"{g('async_pct_of_bound', '{:.1%}')} |")
print(f"| serving run (1B shape) | {status(serve)} |")
rates = ", ".join(f"{r['request_rate']:g}: {r['p99_tpot_ms']:.0f}" for r in srv.get("rates", []))
print(f"| serving: p99 TPOT (ms) by rate (req/s) / highest rate under {srv.get('tpot_slo_ms', 50):g} ms | "
      f"{rates or '-'} / {srv.get('best_rate', '-')} |")
PYEOF
echo "total $(( $(date +%s) - START ))s"
