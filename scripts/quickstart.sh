#!/usr/bin/env bash
# Install kvcdn into ./.venv and run the main job end to end: generate a .kv artifact of a document
# and verify that continuing from it is token-exact against a full prefill.
# Uses the default model (Qwen/Qwen3-0.6B) from the Hugging Face hub; where the hub is unreachable it
# says so and builds a tiny local Qwen3 model from config instead. An up-to-date .venv is not
# reinstalled (see scripts/dev-install.sh). Its work folder is a temporary one, removed at the end,
# unless KVCDN_QUICKSTART_DIR names one to keep.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "quickstart: $*" >&2; }
say "step 1/4: install kvcdn into .venv"
scripts/dev-install.sh --venv .venv
# A folder of its own, removed on every exit (success, failure, Ctrl-C); KVCDN_QUICKSTART_DIR is kept.
if [ -n "${KVCDN_QUICKSTART_DIR:-}" ]; then
  work=$KVCDN_QUICKSTART_DIR
  mkdir -p "$work"
else
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
fi
context="$work/context.txt"
.venv/bin/python -c "from kvcdn_core.model.tiny import SAMPLE_TEXT; print(SAMPLE_TEXT * 4)" > "$context"
model=Qwen/Qwen3-0.6B
say "step 2/4: model $model (checking the Hugging Face hub)"
if ! .venv/bin/python -c "from huggingface_hub import snapshot_download as s; s('$model', allow_patterns=['config.json'])" >/dev/null 2>&1; then
  say "the Hugging Face hub is unreachable from here: using a tiny local Qwen3 model (random weights) instead of $model"
  model="$work/tiny-qwen3"
  .venv/bin/python -m kvcdn_core.model.tiny Qwen3ForCausalLM "$model" >/dev/null
fi
say "step 3/4: generate a .kv artifact of $context (downloads the model the first time)"
.venv/bin/kvcdn generate --model "$model" --context-file "$context" --output "$work/context.kv" --force
say "step 4/4: verify: the artifact's continuation against a full prefill"
.venv/bin/kvcdn verify --kv-path "$work/context.kv" --n 32
