#!/usr/bin/env bash
# DFlash2 drafter for SmolLM2-135M-Instruct on one CUDA GPU in under 10 minutes, offline.
# See recipes/gpu/README.md. Verbs:
#   run.sh --prepare [...]   here: GGUF -> pieces + sha256 + gguf wheel in .gpu_recipe/
#   run.sh --check           there: which pieces arrived intact
#   run.sh [--out DIR ...]   there: setup, datagen, train, eval, export (driver.py run)
#   run.sh --join DIR        here: reassemble the split export in DIR
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
py="${PYTHON:-python3}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
pieces="${DFLASH2_RECIPE_PIECES:-$root/.gpu_recipe}"

verb="${1:-}"
case "$verb" in
  --prepare) shift; exec "$py" "$here/driver.py" prepare --pieces "$pieces" "$@" ;;
  --check) shift; exec "$py" "$here/driver.py" check --pieces "$pieces" "$@" ;;
  --join) shift; exec "$py" "$here/driver.py" join "$@" ;;
esac

# The GGUF conversion needs the gguf package: install the wheel brought beside the pieces
# (not needed with --target, an HF folder).
case " $* " in *" --target "*) need_gguf=0 ;; *) need_gguf=1 ;; esac
if [ "$need_gguf" = 1 ] && ! "$py" -c "import gguf" 2>/dev/null; then
  wheel="$(ls "$pieces"/gguf-*-py3-none-any.whl 2>/dev/null | head -n 1 || true)"
  if [ -z "$wheel" ]; then
    echo "gguf is not installed and no gguf wheel is in $pieces (run.sh --prepare brings one)" >&2
    exit 2
  fi
  site="${TMPDIR:-/tmp}/dflash2-recipe-site"
  "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheel"
  export PYTHONPATH="$PYTHONPATH:$site"
fi
exec "$py" "$here/driver.py" run --pieces "$pieces" "$@"
