#!/usr/bin/env bash
# The whole test suite: unit, property and end-to-end tests of every crate, then the Helm
# chart's test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
profile=default
[ "${CI:-}" = true ] && profile=ci
cargo build --workspace --all-targets --locked
cargo clippy --workspace --all-targets --locked -- -D warnings
# The gateway's module graph points down (no import circle) and no function is over 80 lines.
python3 scripts/layering.py
cargo nextest run --workspace --locked --profile "$profile" "$@"
scripts/test-chart.sh "${CARGO_TARGET_DIR:-target}/debug/switchyard-gateway"
