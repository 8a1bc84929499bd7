#!/usr/bin/env bash
# Install kvcdn and every plugin into ./.venv (created if missing) and run the whole test suite.
# Usage: scripts/test.sh [pytest args...]
#   scripts/test.sh                                 everything (what CI runs)
#   scripts/test.sh -m "not slow and not hosted"    the fast tests only (about 4 CPU-minutes; README has measured times)
#   scripts/test.sh -n 0                            in one process (the default runs one pytest-xdist worker per core)
# Finished steps are skipped: an up-to-date .venv is not reinstalled (see scripts/dev-install.sh),
# and the test issuer's npm packages are installed again only when their lock file changed.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "test.sh: $*" >&2; }
scripts/dev-install.sh --venv .venv
# The hosted tests run a real OIDC issuer (the npm package oidc-provider).
issuer=tests/support/oidc_issuer
if [ -f "$issuer/package-lock.json" ]; then
  lock=$(sha256sum "$issuer/package-lock.json" | cut -d' ' -f1)
  if [ -f "$issuer/node_modules/.kvcdn-lock-sha256" ] && [ "$(cat "$issuer/node_modules/.kvcdn-lock-sha256")" = "$lock" ]; then
    say "npm packages of the test OIDC issuer are up to date"
  else
    say "installing the npm packages of the test OIDC issuer (npm ci)"
    npm ci --silent --no-audit --no-fund --prefix "$issuer"
    echo "$lock" > "$issuer/node_modules/.kvcdn-lock-sha256"
  fi
fi
# One worker per core, each single-threaded. Whole files go to one worker (--dist loadfile): the
# docs examples that start a server on its documented port stay in one process, in order.
# nproc honours OMP_NUM_THREADS, so count the cores before setting it.
workers=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
say "running: python -m pytest -n $workers --dist loadfile $*"
exec .venv/bin/python -m pytest -n "$workers" --dist loadfile "$@"
