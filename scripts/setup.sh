#!/usr/bin/env bash
# Installs what building and testing Switchyard needs. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v cc >/dev/null || need_apt+=(build-essential)
command -v taskset >/dev/null || need_apt+=(util-linux)
command -v curl >/dev/null || need_apt+=(curl)
command -v cmake >/dev/null || need_apt+=(cmake)   # pingora's zlib-ng backend
if ((${#need_apt[@]})); then
  echo "setup: installing ${need_apt[*]} (apt)"
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq "${need_apt[@]}"; \
  else sudo apt-get update -qq && sudo apt-get install -y -qq "${need_apt[@]}"; fi
fi

if ! command -v cargo >/dev/null; then
  echo "setup: cargo not found. Install Rust (https://rustup.rs) and run this again." >&2
  exit 1
fi
if ! cargo nextest --version >/dev/null 2>&1; then
  echo "setup: installing cargo-nextest (crates.io)"
  cargo install --locked cargo-nextest
fi
