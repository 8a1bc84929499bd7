#!/usr/bin/env bash
# Install kvcdn and every plugin into ./.venv (created if missing) and run the whole test suite.
# Usage: scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
PYTHON=.venv/bin/python scripts/dev-install.sh
# The hosted tests run a real OIDC issuer (the npm package oidc-provider).
if [ -f tests/support/oidc_issuer/package-lock.json ]; then
  npm ci --silent --no-audit --no-fund --prefix tests/support/oidc_issuer
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
exec .venv/bin/python -m pytest "$@"
