#!/usr/bin/env bash
# Real vLLM 0.32.0 + SPEEDSFI end to end ON THE GPU MACHINE (run from the repository root), with the
# payload of scripts/gpu_vllm_bundle.sh carried in (device tool: carry [".gpu_payload/carry",
# ".gpu_payload/carry_deps"] when the bundle says "one call: ... (ok)", else see "stash").
#
#   scripts/gpu_e2e.sh STAGES [OUTDIR] [-- bench/vllm_e2e.py options]
#
# STAGES: "call1" .. "call6" (the documented invocation: bench/vllm_e2e.py --call N), or stage names,
# comma separated (run in bench/vllm_e2e.py's order; e2e_stages.py describes each):
#   stash    keep the carried payload folders' archives on the warm machine for the next call (within
#            ~30 s): carry [".gpu_payload/carry_deps"] when the two do not fit one call, then run with
#            carry [".gpu_payload/carry"]; fallback: one stash call per ".gpu_payload/carry_so_full_<i>"
#            makes later calls unpack the whole _C library instead of the sm_90-pruned one
#   smoke, graphs, kernels, sfi_perf, correct, quality, perf, critiprefill, serving; all
#
# The calls (each <= 520 s of driver time; "python3 bench/vllm_e2e.py --call N --dry-run" prints the
# plan and its estimate), in this order, 1 and 2 in a session's 15 minutes of device time, one after
# the other on the warm machine ("python3 bench/vllm_e2e.py session" prints the budget):
#   call1  SFI under FULL CUDA graphs == eager, each row once; Qwen3-4B shape at 32K with the batch
#          that fills the KV cache: SFI preset (dense rows on vLLM's pick) vs vLLM's default, each
#          with a kernel table of a decode window
#   call2  all off with dense_delegate auto == FLASH_ATTN on the V1 runner (token for token)
#   call3  128K rows
#   call4  8K rows; serving (vllm serve + vllm bench serve, 32K prompts at 0.5 req/s)
#   call5  32K: the runner's share, all off, SFI + SPEED, CritiPrefill TTFT; kernel-only read rates
#   call6  Llama-3.1-8B shape token checks; quality (retrieval-llama vs the CPU)
# Options after "--" go to bench/vllm_e2e.py, e.g. -- --batches 131072:max (bench/vllm_e2e.py --help).
#
# OUTDIR (default $OUT, else bench/results/vllm_e2e): vllm_e2e.json, vllm_e2e.png, vllm_e2e.log,
# vllm_e2e_logs.tar.gz (one log per configuration), quality_gpu_retrieval-llama.{json,md}.
# Time budget: GPU_E2E_BUDGET_S (default 540 s) from this script's start; the driver skips what no
# longer fits (recorded as skipped) and always writes what it has. Never patches vLLM's files.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
T0=$(date +%s)
stages=${1:-smoke}
shift || true
OUTDIR=${OUT:-$root/bench/results/vllm_e2e}
if [ $# -gt 0 ] && [ "$1" != "--" ]; then OUTDIR=$1; shift; fi
[ "${1:-}" = "--" ] && shift
mkdir -p "$OUTDIR"
LOG=$OUTDIR/vllm_e2e.log
PY=${PYTHON:-python3}
SITE=${VLLM_SITE:-/tmp/vllm_site}
BUDGET=${GPU_E2E_BUDGET_S:-540}   # the driver gets what is left after the unpack (its plans fit 520 s)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
say() { echo "[gpu_e2e +$(( $(date +%s) - T0 ))s] $*"; }

run_all() {
  say "stages '$stages' -> $OUTDIR (budget ${BUDGET}s)"
  if [[ ",$stages," == *",stash,"* ]]; then
    "$PY" scripts/gpu_vllm_unpack.py --stash
    local rc=$?
    stages=$(echo ",$stages," | sed 's/,stash,/,/; s/^,//; s/,$//')
    if [ -z "$stages" ] || [ "$rc" -ne 0 ]; then say "stash done (exit status $rc)"; return $rc; fi
  fi
  local sel=("$stages")
  [[ "$stages" == call[0-9] ]] && sel=(--call "${stages#call}")
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
    | sed 's/^/[gpu_e2e] gpu: /'
  local t=$(date +%s)
  if ! "$PY" scripts/gpu_vllm_unpack.py --target "$SITE"; then
    say "unpacking the payload failed: are .gpu_payload/carry and carry_deps carried (or stashed)?"
    "$PY" bench/vllm_e2e.py note --out "$OUTDIR" --error "payload unpack failed (see vllm_e2e.log)" || true
    return 2
  fi
  say "unpack: $(( $(date +%s) - t ))s"
  export PYTHONPATH="$SITE:$root${PYTHONPATH:+:$PYTHONPATH}"
  export VLLM_SITE="$SITE"
  local elapsed=$(( $(date +%s) - T0 ))
  "$PY" bench/vllm_e2e.py "${sel[@]}" --out "$OUTDIR" --deadline-s $(( BUDGET - elapsed )) "$@"
  local rc=$?
  say "done: stages '$stages', exit status $rc, $(( $(date +%s) - T0 ))s in all; files in $OUTDIR:"
  ls -la "$OUTDIR"
  return $rc
}

run_all "$@" 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
