#!/usr/bin/env bash
# The test suite under load: runs the nextest part of scripts/test.sh N times in a row
# (default 5) while two busy loops keep both cores of a 2-core machine saturated, and stops
# at the first failing run. This is how we show the suite passes on a loaded machine.
#
#   scripts/stress-suite.sh [N] [NEXTEST ARGS...]
#   scripts/stress-suite.sh 5                        # the whole suite, 5 times
#   scripts/stress-suite.sh 1 -E 'group(timing)'     # only the timing-sensitive tests, once
#
# Builds first (unloaded), then starts the loops; they are killed on exit, whatever the exit.
# Logs of each run go to .cache/stress/run-K.log. Exit status: 0 when every run passed, the
# failing run's nextest status otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

runs=5
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then
  runs=$1
  shift
fi
((runs >= 1)) || { echo "stress-suite: N must be at least 1" >&2; exit 2; }
profile=default
[ "${CI:-}" = true ] && profile=ci

scripts/setup.sh
cargo build --workspace --all-targets --locked

loops=()
stop_loops() {
  for pid in "${loops[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  for pid in "${loops[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
}
trap stop_loops EXIT
trap 'exit 130' INT TERM
for _ in 1 2; do
  bash -c 'while :; do :; done' &
  loops+=($!)
done
echo "stress-suite: busy loops ${loops[*]} running; $runs run(s) of: cargo nextest run --workspace --locked --profile $profile $*"

mkdir -p .cache/stress
for ((k = 1; k <= runs; k++)); do
  log=".cache/stress/run-$k.log"
  start=$SECONDS
  echo "stress-suite: run $k of $runs (log: $log)"
  set +e
  cargo nextest run --workspace --locked --profile "$profile" "$@" 2>&1 | tee "$log"
  status=${PIPESTATUS[0]}
  set -e
  if ((status != 0)); then
    echo "stress-suite: run $k of $runs FAILED (nextest exit $status, after $((SECONDS - start)) s); log: $log" >&2
    grep -E '^\s+(FAIL|TIMEOUT|SIGSEGV|SIGABRT)' "$log" >&2 || true
    exit "$status"
  fi
  echo "stress-suite: run $k of $runs passed in $((SECONDS - start)) s"
done
echo "stress-suite: all $runs run(s) passed with both cores busy"
