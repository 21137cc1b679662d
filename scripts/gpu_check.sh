#!/usr/bin/env bash
# The one prepared device check (issue 27), for a bare lent GPU machine: Python 3.12, torch,
# Triton, nvcc; no SGLang, no FlashInfer, no pytest needed, no internet. Runs from the
# repository root of a working-tree copy, in about 6 minutes (351 s at 1348b4a); the step
# limits below, 11.5 minutes together, only bound a hang:
#   1. the kernel checks compiled on CUDA (test/kernel_checks.py, every family)   <= 220 s
#   2. benchmark/bench_kernels.py: launch search, draft vs full-KV, the loader   <= 260 s
#   3. the serving path's GPU tests: issue 29's CUDA-graph decision check and the full-KV
#      parking's CUDA path (side-stream loads, pinned copies)                      <= 60 s each
#   4. benchmark/bench_warm_up.py: the start-up kernel warm-up, cold and restarted <= 90 s
# Results go to $OUT (or ./gpu_check_out): gpu_check.log, kernel_checks.log, bench_kernels.json,
# bench_warm_up.json.
# Each step's failure is logged and the next one still runs; the exit status is the first failure's.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT_DIR="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # compiled kernels here
LOG="$OUT_DIR/gpu_check.log"
status=0

log() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "$LOG"; }

step() {  # step NAME SECONDS CMD...: run with a time limit, log, remember the first failure
  local name="$1" limit="$2"
  shift 2
  log "start $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$OUT_DIR/$name.log"
  local rc=${PIPESTATUS[0]}
  log "end $name: rc=$rc in $((SECONDS - t0))s"
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}

environment() {
  log "commit: $(git rev-parse HEAD 2>/dev/null || echo 'unknown (no git here)')"
  "$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import importlib.util, platform, torch, triton
print("python", platform.python_version(), "torch", torch.__version__, "triton", triton.__version__,
      "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for name in ("sglang", "flashinfer", "pytest"):
    print(f"{name} installed: {importlib.util.find_spec(name) is not None}")
EOF
  nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv 2>&1 | tee -a "$LOG" || true
}

kernel_checks() {
  # 225 cases at 2026-12-07 (109 ran in 162 s in one process at 1348b4a): Triton's compiles are
  # single-threaded, so 14 of the 16 cores; no case starts after 190 s, so the step ends with
  # every line it ran and the rest named as not run, not killed at its limit
  step kernel_checks 220 "$PY" test/kernel_checks.py --device cuda --jobs 14 --budget-s 190
}

bench_kernels() {
  VERICACHE_COMMIT="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
  export VERICACHE_COMMIT
  step bench_kernels 260 "$PY" benchmark/bench_kernels.py --tune-budget-s 140 --budget-s 210 --out "$OUT_DIR/bench_kernels.json"
}

# The serving path's tests that import no SGLang and have GPU cases: issue 29's CUDA-graph
# decision (test_gpu_launch.py) and the full-KV parking's CUDA path (test_full_kv_parking.py:
# pinned host copies, loads on a side stream, a delayed side stream against slot reuse).
# With pytest when it is installed, else each file as a plain script (its GPU tests).
gpu_tests() {
  local noconf=()  # test/conftest.py imports requests, which a bare machine may lack
  "$PY" -c "import requests" 2>/dev/null || noconf=(--noconftest)
  local name file
  for name in issue29_cuda_graph:test/test_gpu_launch.py parking_cuda:test/test_full_kv_parking.py; do
    file="${name#*:}"
    if "$PY" -c "import pytest" 2>/dev/null; then
      step "${name%%:*}" 60 "$PY" -m pytest -q -p no:cacheprovider "${noconf[@]}" "$file"
    else
      step "${name%%:*}" 60 "$PY" "$file"
    fi
  done
}

warm_up() {
  step bench_warm_up 90 "$PY" benchmark/bench_warm_up.py --shapes llama3-8b --out "$OUT_DIR/bench_warm_up.json"
}

log "gpu_check: results in $OUT_DIR"
environment
kernel_checks
bench_kernels
gpu_tests
warm_up
log "gpu_check done in ${SECONDS}s, status $status"
exit "$status"
