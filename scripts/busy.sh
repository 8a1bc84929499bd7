#!/usr/bin/env bash
# Run a command while CPU-bound workers keep the cores busy, then stop them: the busy-machine check.
# Usage: scripts/busy.sh [-n WORKERS] -- COMMAND [ARGS...]
#   scripts/busy.sh -n 2 -- bash scripts/test.sh -q     the whole suite on a machine kept busy by 2 workers
# WORKERS defaults to the number of cores. The exit status is the command's; the load average is
# printed when the command starts and every 5 minutes while it runs, so a report can quote it.
set -euo pipefail
workers=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc honours OMP_NUM_THREADS
if [ "${1:-}" = "-n" ]; then workers=$2; shift 2; fi
if [ "${1:-}" != "--" ] || [ $# -lt 2 ]; then
  echo "usage: scripts/busy.sh [-n WORKERS] -- COMMAND [ARGS...]" >&2
  exit 2
fi
shift
say() { echo "busy.sh: $*" >&2; }
pids=()
stop() { [ ${#pids[@]} -eq 0 ] || kill "${pids[@]}" 2>/dev/null || true; }
trap stop EXIT
for _ in $(seq "$workers"); do
  ( trap 'exit 0' TERM; while :; do :; done ) &
  pids+=($!)
done
( while sleep 300; do say "load average $(cut -d' ' -f1-3 /proc/loadavg)"; done ) &
pids+=($!)
say "$workers busy workers started; load average $(cut -d' ' -f1-3 /proc/loadavg)"
start=$(date +%s)
status=0
"$@" || status=$?
say "command exited $status after $(( $(date +%s) - start )) s; load average $(cut -d' ' -f1-3 /proc/loadavg)"
exit $status
