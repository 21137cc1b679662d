#!/usr/bin/env bash
# Rehearse scripts/gpu_check.sh on a CPU with the lent GPU machine's software: a venv of
# Python 3.12, torch 2.11 and Triton 3.6 (no SGLang, no FlashInfer, no pytest), running
# what of the check a CPU can: the kernel checks and bench_kernels' / bench_warm_up's code
# paths under Triton's interpreter, test_gpu_launch.py and test_full_kv_parking.py as plain
# scripts (the latter's CPU part: its GPU tests need CUDA). Catches an API or
# version difference before a device session spends its 15 minutes on it. Not part of the
# test suite (the venv is ~3 GB of wheels, fetched once into $REHEARSE_VENV).
#   bash scripts/rehearse_gpu_check.sh           # ~2 min once the venv exists
# numpy is pinned below 2.4: Triton 3.6's interpreter calls int() on one-element arrays,
# which numpy 2.4 and 2.5 refuse (Triton 3.8 does not); compiled kernels never reach that code.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${REHEARSE_VENV:-$HOME/.cache/sgl_vericache/rehearse-py312}"
OUT_DIR="${OUT:-$PWD/rehearse_out}"
say() { echo "[rehearse $(date +%H:%M:%S)] $*"; }

if [ ! -x "$VENV/bin/python" ]; then
    PY312="$(command -v python3.12 || true)"
    if [ -z "$PY312" ] || ! "$PY312" -c pass 2>/dev/null; then
        PY312="$(ls -d "$HOME"/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -1 || true)"
    fi
    [ -n "$PY312" ] || { echo "rehearse: no Python 3.12 found (python3.12 on PATH or under ~/.pyenv)" >&2; exit 2; }
    say "creating $VENV with $PY312"
    "$PY312" -m venv "$VENV"
    say "installing torch 2.11.0, triton 3.6.0, numpy<2.4 (several GB the first time)"
    "$VENV/bin/pip" install -q "torch==2.11.0" "triton==3.6.0" "numpy<2.4"
fi
"$VENV/bin/python" - <<'EOF'
import platform, torch, triton, numpy
print("python", platform.python_version(), "torch", torch.__version__, "triton", triton.__version__,
      "numpy", numpy.__version__)
EOF
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
status=0
run() {  # run NAME CMD...: log, remember the first failure, go on
    local name="$1"
    shift
    say "start $name"
    if "$@" > "$OUT_DIR/$name.log" 2>&1; then
        say "ok $name: $(tail -1 "$OUT_DIR/$name.log")"
    else
        status=1
        say "FAILED $name (last lines of $OUT_DIR/$name.log):"
        tail -15 "$OUT_DIR/$name.log"
    fi
}
run kernel_checks env TRITON_INTERPRET=1 "$VENV/bin/python" test/kernel_checks.py --device cpu --jobs 2
run bench_kernels env TRITON_INTERPRET=1 "$VENV/bin/python" benchmark/bench_kernels.py --smoke --out "$OUT_DIR/bench_kernels.json"
run bench_warm_up env TRITON_INTERPRET=1 "$VENV/bin/python" benchmark/bench_warm_up.py --smoke --out "$OUT_DIR/bench_warm_up.json"
run test_gpu_launch "$VENV/bin/python" test/test_gpu_launch.py
run parking_cuda "$VENV/bin/python" test/test_full_kv_parking.py  # its CPU part: the GPU tests need CUDA
say "done, status $status (logs in $OUT_DIR)"
exit "$status"
