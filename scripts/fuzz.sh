#!/usr/bin/env bash
# Fuzz the gateway (gateway/fuzz): the request path (target `request`) and the KV-event
# decoder (target `kv_events`), each for a fixed budget.
#
#   scripts/fuzz.sh [SECONDS [TARGET]]     (default 120 s each, both targets)
#
# Needs the nightly toolchain (libFuzzer's instrumentation) and cargo-fuzz, installed here if
# missing. New corpus entries go to .cache/fuzz/corpus (the checked-in seeds stay as they
# are). A crash is copied into gateway/fuzz/regressions/, which the normal test suite replays
# on stable (gateway/tests/fuzz_regressions.rs): commit it with the fix.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_BUDGET="${1:-120}"
rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
WORK=.cache/fuzz
status=0
found=0
for target in ${2:-request kv_events}; do
  regressions=gateway/fuzz/regressions
  [ "$target" = request ] || regressions="$regressions/$target"
  mkdir -p "$WORK/corpus/$target" "$WORK/artifacts/$target"
  (cd gateway && cargo +nightly fuzz run "$target" "../$WORK/corpus/$target" "fuzz/corpus/$target" -- \
    -max_total_time="$SECONDS_BUDGET" -artifact_prefix="../$WORK/artifacts/$target/" -max_len=65536) || status=$?
  for f in "$WORK"/artifacts/"$target"/*; do
    [ -f "$f" ] || continue
    cp "$f" "$regressions/"
    echo "fuzz: finding saved as $regressions/$(basename "$f")"
    found=1
  done
done
if [ "$status" -ne 0 ] || [ "$found" -ne 0 ]; then
  echo "fuzz: FAILED (exit $status); replay with: cargo test -p switchyard-gateway --test fuzz_regressions" >&2
  exit 1
fi
echo "fuzz: ${SECONDS_BUDGET}s per target without a finding"
