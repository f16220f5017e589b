#!/usr/bin/env bash
# The test command: installs everything on a fresh machine, then runs the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
rc=0
python -m pytest -q -p no:cacheprovider tests "$@" || rc=$?
# pytest exits 5 when it collected no tests: that is a failure for us too.
exit $rc
