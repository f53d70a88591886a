#!/usr/bin/env bash
# Real vLLM 0.32.0 + SPEEDSFI end to end ON THE GPU MACHINE (run from the repository root), with the
# payload of scripts/gpu_vllm_bundle.sh carried in (device tool: carry [".gpu_payload/carry",
# ".gpu_payload/carry_deps"] when the bundle says "one call: ... (ok)", else see "stash").
#
#   scripts/gpu_e2e.sh STAGES [OUTDIR] [-- bench/vllm_e2e.py options]
#
# STAGES, comma separated (run in this order):
#   stash    keep the carried payload folders' archives on the warm machine for the next call (within
#            ~30 s): carry [".gpu_payload/carry_deps"] when the two do not fit one call, then run with
#            carry [".gpu_payload/carry"]; fallback: one stash call per ".gpu_payload/carry_so_full_<i>"
#            makes later calls unpack the whole _C library instead of the sm_90-pruned one
#   smoke    _C ops vs PyTorch, imports + plugin entry point, a 4-layer model through SPEEDSFI
#            with a small SFI budget                                                        (~1.2 min)
#   correct  Llama-3.1-8B and Qwen3-4B shapes (random weights, bf16, greedy, eager): TRITON_ATTN ==
#            SPEEDSFI all off == SFI with a budget covering the context; SFI default preset runs
#            fast steps (counters); TRITON_ATTN on Model Runner V2 last (information)       (~6 min)
#   quality  scripts/eval_quality.py on models/retrieval-llama (dense, SFI k256, SFI k256 span 4;
#            180 samples each) vs the CPU numbers of bench/QUALITY.md                       (~2 min)
#   perf     Qwen3-4B shape: TRITON_ATTN vs SPEEDSFI dense / SFI preset, 8K..128K input, 256
#            output, CUDA graphs and eager: TPOT, TTFT, tok/s, KV GB/s vs copy bandwidth    (~8-9 min)
#   all      smoke,correct,quality,perf (more than one call's 10 minutes: split it)
#
# Two device calls (run, carry as above, timeout_s 600):
#   scripts/gpu_e2e.sh smoke,correct,quality          then          scripts/gpu_e2e.sh perf
# Options after "--" go to bench/vllm_e2e.py, e.g. -- --modes graph --batches 131072:max
# (bench/vllm_e2e.py --help; "python3 bench/vllm_e2e.py perf --dry-run" prints a plan + estimate).
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
BUDGET=${GPU_E2E_BUDGET_S:-540}
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
  [ "$stages" = all ] && stages=smoke,correct,quality,perf
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
  "$PY" bench/vllm_e2e.py "$stages" --out "$OUTDIR" --deadline-s $(( BUDGET - elapsed )) "$@"
  local rc=$?
  say "done: stages '$stages', exit status $rc, $(( $(date +%s) - T0 ))s in all; files in $OUTDIR:"
  ls -la "$OUTDIR"
  return $rc
}

run_all "$@" 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
