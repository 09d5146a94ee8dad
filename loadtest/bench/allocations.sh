#!/usr/bin/env bash
# Heap allocations the gateway makes per request (issue #23), counted by a counting global
# allocator around the gateway binary's own (tests/benches/gateway_allocations.rs): the
# gateway in-process with its default configuration in front of an `instant` sim engine,
# streamed 16-in/16-out completions one after another on one keep-alive connection.
#
# Bar: at most SWITCHYARD_ALLOC_BAR allocations per request (default 20: 17.1 measured once the
# connections' write buffers were reused and a body read with its head was no longer copied,
# so a change that adds allocations to the request path shows up).
# Exit status: 0 bar met, 1 bar missed, 2 setup error (a build or the run failed).
#
# Usage: loadtest/bench/allocations.sh   (takes ~1 minute once built)
set -euo pipefail
trap 'echo "setup error: line $LINENO failed" >&2; exit 2' ERR
cd "$(dirname "$0")/../.."
cargo build --release --locked -p switchyard-engine -p switchyard-gateway -p switchyard-loadtest
export SWITCHYARD_ALLOC_BAR="${SWITCHYARD_ALLOC_BAR:-20}"
trap - ERR
# stdout carries the gateway's access log; the figures and the bar are on stderr.
cargo bench --locked -p switchyard-tests --bench gateway_allocations >/dev/null
