#!/usr/bin/env bash
# Build the release: sdist + wheel of kvcdn and of every package under plugins/ into dist/, check
# their metadata, install the built wheels (not the sources) into a fresh virtual environment, smoke
# test them, write a CycloneDX SBOM of that environment and dist/SHA256SUMS. Fails if any step fails.
#
# Usage: scripts/build-release.sh            (needs python3 with venv; uses ./.venv-release for tools)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
dist="$root/dist"
tools="$root/build/release-tools"
smoke="$root/build/release-smoke"
torch_pin="torch==${KVCDN_TORCH_VERSION:-2.13.0}"

rm -rf "$dist" "$smoke"
mkdir -p "$dist"
[ -x "$tools/bin/python" ] || python3 -m venv "$tools"
"$tools/bin/python" -m pip install --quiet build twine "setuptools>=68" wheel

echo "== building"
for pkg in . plugins/*/; do
  "$tools/bin/python" -m build --no-isolation --sdist --wheel --outdir "$dist" "$pkg" >/dev/null
  echo "built $(basename "$(cd "$pkg" && pwd)")"
done
"$tools/bin/python" -m twine check --strict "$dist"/*

echo "== installing the wheels into a fresh environment"
python3 -m venv "$smoke"
"$smoke/bin/python" -m pip install --quiet "$torch_pin"   # pinned first: never a CUDA build by accident
"$smoke/bin/python" -m pip install --quiet --find-links "$dist" 'kvcdn[all]'
for whl in "$dist"/*.whl; do   # every wheel, not a source tree, must be what got installed
  name=$(basename "$whl" | cut -d- -f1 | tr _ -)
  loc=$("$smoke/bin/python" -m pip show -f "$name" | sed -n 's/^Location: //p')
  case "$loc" in "$root"|"$root"/plugins/*) echo "error: $name installed from the source tree" >&2; exit 1;; esac
done

echo "== smoke test"
cd "$smoke"   # away from the checkout, so nothing imports from the sources
"$smoke/bin/kvcdn" --version
"$smoke/bin/kvcdn" plugins
"$smoke/bin/kvcdn" plugins --format json | "$smoke/bin/python" -c '
import json, sys
rows = json.load(sys.stdin)
bad = [r["name"] for r in rows if r["status"] != "loaded"]
sys.exit(f"plugins not loaded: {bad}" if bad else 0)'
"$smoke/bin/kvcdn" validate
cd "$root"

echo "== SBOM and checksums"
version=$("$smoke/bin/python" -c 'import kvcdn_core; print(kvcdn_core.__version__)')
"$smoke/bin/python" scripts/sbom.py "$dist/kvcdn-$version.sbom.json" kvcdn
(cd "$dist" && sha256sum -- *.whl *.tar.gz *.sbom.json > SHA256SUMS)
echo "release in $dist:"
ls -1 "$dist"
