#!/usr/bin/env bash
# The main job: set up, then run the speculative-decoding demo on the default models.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
python examples/demo.py "$@"
