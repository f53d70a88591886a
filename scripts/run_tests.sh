#!/usr/bin/env bash
# The whole test suite, on a fresh machine: set up .venv (idempotent), then run pytest.
# On a machine without a GPU the CUDA-only tests are skipped; everything else runs
# (unit tests, kernels under TRITON_INTERPRET=1, real vLLM end to end on the CPU build).
#   scripts/run_tests.sh [pytest args]            # e.g. -m "not slow" for the fast subset
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup_env.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest -q -rs --durations=15 "$@"
