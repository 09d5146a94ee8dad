#!/usr/bin/env bash
# Fuzz the gateway's request path (gateway/fuzz, target `request`) for a fixed budget.
#
#   scripts/fuzz.sh [SECONDS]     (default 120)
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
mkdir -p "$WORK/corpus" "$WORK/artifacts"
cd gateway
status=0
cargo +nightly fuzz run request "../$WORK/corpus" fuzz/corpus/request -- \
  -max_total_time="$SECONDS_BUDGET" -artifact_prefix="../$WORK/artifacts/" -max_len=65536 || status=$?
cd ..
found=0
for f in "$WORK"/artifacts/*; do
  [ -f "$f" ] || continue
  cp "$f" gateway/fuzz/regressions/
  echo "fuzz: finding saved as gateway/fuzz/regressions/$(basename "$f")"
  found=1
done
if [ "$status" -ne 0 ] || [ "$found" -ne 0 ]; then
  echo "fuzz: FAILED (exit $status); replay with: cargo test -p switchyard-gateway --test fuzz_regressions" >&2
  exit 1
fi
echo "fuzz: ${SECONDS_BUDGET}s without a finding ($(ls "$WORK/corpus" | wc -l) corpus entries)"
