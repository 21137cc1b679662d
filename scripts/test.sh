#!/usr/bin/env bash
# Set up (idempotent) and run the test suite on this machine (CPU-only is fine: GPU tests
# skip, `slow` tests are left out unless VERICACHE_SLOW=1). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
markers="not slow"
[ "${VERICACHE_SLOW:-0}" = "1" ] && markers=""
exec .venv/bin/python -m pytest -ra --durations=20 ${markers:+-m "$markers"} "$@"
