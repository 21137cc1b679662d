#!/usr/bin/env bash
# Set up (idempotent) and serve the embedded default model with VeriCache on
# http://127.0.0.1:30000. Extra arguments go to `python -m sgl_vericache.launch_server`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python -m sgl_vericache.launch_server "$@"
