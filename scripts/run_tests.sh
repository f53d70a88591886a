#!/usr/bin/env bash
# The whole test suite, on a fresh machine: set up .venv (idempotent), then run pytest.
# On a machine without a GPU the CUDA-only tests are skipped; everything else runs
# (unit tests, kernels under TRITON_INTERPRET=1, real vLLM end to end on the CPU build).
#   scripts/run_tests.sh [pytest args]            # e.g. -m "not slow" for the fast subset
#
# Two pytest workers (pytest-xdist), each taking a whole test file at a time (--dist loadfile: a
# module's shared engine stays in one process), with one OpenMP thread each, so a 2-core machine
# runs two engines or interpreted kernels side by side (how long it took last: README.md, "Start
# here", from bench/results/first_hour.json). SPEEDSFI_TEST_WORKERS=0 runs in one process; any other
# count is passed to -n.
# The last line says how long the set-up and the suite took.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup_env.sh"
setup_s=$SECONDS
cd "$root"
workers=${SPEEDSFI_TEST_WORKERS:-2}
par=()
if [ "$workers" != "0" ]; then
  # --no-loadscope-reorder: files in collection order (tests/conftest.py puts the slow ones first),
  # not xdist's default of the files with the most tests first
  par=(-n "$workers" --dist loadfile --no-loadscope-reorder)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
status=0
"$root/.venv/bin/python" -m pytest -q -rs --durations=15 "${par[@]}" "$@" || status=$?
mmss() { printf '%d min %02d s' $(($1 / 60)) $(($1 % 60)); }
echo "[run_tests] wall time $(mmss $SECONDS): set-up $(mmss "$setup_s"), pytest $(mmss $((SECONDS - setup_s))) (exit status $status)"
exit "$status"
