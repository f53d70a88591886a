#!/usr/bin/env bash
# What a lent GPU must show, in at most two device calls (each under the 10-minute call limit):
#
#   scripts/gpu_check.sh tests    # 1: kernel, SFI and CritiPrefill tests natively on CUDA
#   scripts/gpu_check.sh bench    # 2: the benchmarks -> JSON + PNG (GPU name in every JSON)
#   scripts/gpu_check.sh          # both in one call
#
# Results go to ${RESULTS:-${OUT:-bench/results}}/ (pytest log, JUnit XML, bench JSON/PNG/logs).
# BUNDLE=/path/results.tar.gz also packs that folder into one file (the device tool returns at most
# 8 files per call). Needs python3 with torch + triton (+ pytest, matplotlib); no vLLM.
# Measured on an H100 (2026-11-22): tests/kernels alone ~70 s with 8 workers; the three test folders
# together took more than 300 s; the benches ~350 s.
# Exit status: non-zero if the tests failed or a bench crashed (every step still runs).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
what=${1:-all}
PY=${PYTHON:-python3}
RESULTS=${RESULTS:-${OUT:-bench/results}}
mkdir -p "$RESULTS"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0

"$PY" - <<'EOF' | tee "$RESULTS/gpu_info.txt"
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NONE")
EOF
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "[gpu_check] no CUDA device visible: nothing to check" >&2
  exit 2
fi

if [ "$what" = all ] || [ "$what" = tests ]; then
  dirs=()
  for d in tests/kernels tests/sfi tests/critiprefill tests/speed tests/test_sfi_layer.py tests/test_sfi_path.py; do [ -e "$d" ] && dirs+=("$d"); done
  xdist=()
  if "$PY" -c 'import xdist' 2>/dev/null; then xdist=(-n "${GPU_CHECK_WORKERS:-12}"); fi
  echo "[gpu_check] pytest ${dirs[*]} -m 'not e2e' on CUDA"
  # Fixed kernel tiles in the tests (autotuning every tested shape would mostly measure compiles);
  # the benchmarks below run autotuned.
  SPEEDSFI_AUTOTUNE=0 timeout "${GPU_CHECK_TEST_TIMEOUT:-540}" "$PY" -m pytest "${dirs[@]}" \
      -m "not e2e" -q "${xdist[@]}" -p no:randomly --junitxml="$RESULTS/gpu_tests.xml" \
      2>&1 | tee "$RESULTS/gpu_tests.log" | tail -n 25
  rc=${PIPESTATUS[0]}
  echo "[gpu_check] tests exit status $rc"
  [ "$rc" -ne 0 ] && status=1
fi

if [ "$what" = all ] || [ "$what" = bench ]; then
  benches=(bench/bench_sfi_path.py bench/bench_selector.py bench/bench_fast_step.py
           bench/bench_bandwidth.py bench/bench_model_step.py)
  [ -f bench/bench_critiprefill.py ] && benches+=(bench/bench_critiprefill.py)
  benches+=(bench/bench_speed.py bench/tune_fixed_tiles.py)
  for b in "${benches[@]}"; do
    name=$(basename "$b" .py)
    echo "[gpu_check] $b"
    limit=${GPU_CHECK_BENCH_TIMEOUT:-300}
    # the whole-path bench (2 models x 3 contexts x 3 batches x 4 modes x 256 steps) needs longer
    [ "$name" = bench_sfi_path ] && limit=${GPU_CHECK_PATH_TIMEOUT:-540}
    timeout "$limit" "$PY" "$b" --out "$RESULTS" 2>&1 \
        | tee "$RESULTS/$name.log" | grep -v '^\[bench\] wrote' | tail -n 40
    rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then echo "[gpu_check] $b failed ($rc)"; status=1; fi
  done
  # the Quest selector's whole path (a selection every step; page 16, and page 8 with keep_prefill)
  echo "[gpu_check] bench/bench_sfi_path.py --modes dense,quest,quest_keep,quest_rerank"
  timeout "${GPU_CHECK_BENCH_TIMEOUT:-300}" "$PY" bench/bench_sfi_path.py --out "$RESULTS" \
      --models Llama-3.1-8B --batches 1,16 --modes dense,quest,quest_keep,quest_rerank 2>&1 \
      | tee "$RESULTS/bench_sfi_path_quest.log" | grep -v '^\[bench\] wrote' | tail -n 20
  rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then echo "[gpu_check] quest path bench failed ($rc)"; status=1; fi
fi

if [ -n "${BUNDLE:-}" ]; then
  tar czf "$BUNDLE" -C "$RESULTS" . && echo "[gpu_check] bundled $RESULTS into $BUNDLE"
fi
echo "[gpu_check] done: status $status (results in $RESULTS)"
exit $status
