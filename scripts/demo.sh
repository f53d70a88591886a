#!/usr/bin/env bash
# The main job, on a fresh machine: set up .venv (idempotent), then serve a model with
# `vllm serve --attention-backend speedsfi`, ask it through the OpenAI client, print the answer and
# the backend's counters, and stop the server.
#   scripts/demo.sh                               # embedded tiny model, built locally
#   scripts/demo.sh --model Qwen/Qwen3-4B --additional-config '{"speedsfi": {"preset": "dense"}}'
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup_env.sh"
exec "$root/.venv/bin/python" -m vllm_ext.tools.demo "$@"
