#!/usr/bin/env bash
# The main job, on a fresh machine: set up .venv (idempotent), then serve the committed retrieval
# model with `vllm serve --attention-backend speedsfi` once per method (dense, SFI, SPEED,
# CritiPrefill), ask each the same long-context retrieval question through the OpenAI client, print
# the question, the expected answer, every answer, the KV each method kept and its counters.
#   scripts/demo.sh                               # the method on models/retrieval-llama
#   scripts/demo.sh --methods dense,sfi --task kv_lookup --length 1024 --depth 0.25
#   scripts/demo.sh --model Qwen/Qwen3-4B --additional-config '{"speedsfi": {"preset": "dense"}}'
#   scripts/demo.sh --model Qwen/Qwen3-4B --compare             # every method, a RULER text prompt
#   scripts/demo.sh --tiny                        # one prompt to an embedded tiny Qwen3 (random weights)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup_env.sh"
exec "$root/.venv/bin/python" -m vllm_ext.tools.demo "$@"
