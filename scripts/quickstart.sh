#!/usr/bin/env bash
# Install kvcdn into ./.venv and run the main job end to end: generate a .kv artifact of a document
# and verify that continuing from it is token-exact against a full prefill.
# Uses the default model (Qwen/Qwen3-0.6B) from the Hugging Face hub; where the hub is unreachable it
# says so and builds a tiny local Qwen3 model from config instead.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
PYTHON=.venv/bin/python scripts/dev-install.sh
work=${KVCDN_QUICKSTART_DIR:-$(mktemp -d)}
mkdir -p "$work"
context="$work/context.txt"
.venv/bin/python -c "from kvcdn_core.tiny import SAMPLE_TEXT; print(SAMPLE_TEXT * 4)" > "$context"
model=Qwen/Qwen3-0.6B
if ! .venv/bin/python -c "from huggingface_hub import snapshot_download as s; s('$model', allow_patterns=['config.json'])" >/dev/null 2>&1; then
  echo "The Hugging Face hub is unreachable from here: using a tiny local Qwen3 model (random weights) instead of $model." >&2
  model="$work/tiny-qwen3"
  .venv/bin/python -m kvcdn_core.tiny Qwen3ForCausalLM "$model" >/dev/null
fi
.venv/bin/kvcdn generate --model "$model" --context-file "$context" --output "$work/context.kv"
.venv/bin/kvcdn verify --kv-path "$work/context.kv" --n 32
