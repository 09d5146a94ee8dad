#!/usr/bin/env bash
# The Helm chart's test (helm/tests/test_chart.py): Helm's own engine renders the chart into a
# fake Kubernetes API server, the objects are checked against the Kubernetes schemas and the
# rendered gateway config against `switchyard-gateway --validate`.
#
# Needs Python >= 3.12 (helm-sdkpy's requirement): the pyenv 3.12 interpreter when present,
# else python3.12 on PATH. Its packages go into a virtualenv under .cache (once).
set -euo pipefail
cd "$(dirname "$0")/.."
GATEWAY="${1:-${CARGO_TARGET_DIR:-target}/debug/switchyard-gateway}"
[ -x "$GATEWAY" ] || { echo "test-chart: $GATEWAY is missing: build the workspace first" >&2; exit 1; }
PY=""
if command -v pyenv >/dev/null; then
  v="$(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9])' | head -1 || true)"
  [ -n "$v" ] && PY="$(PYENV_VERSION="$v" pyenv which python3)"
fi
if [ -z "$PY" ]; then
  for c in python3.13 python3.12 python3; do
    if command -v "$c" >/dev/null && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      PY="$(command -v "$c")"; break
    fi
  done
fi
[ -n "$PY" ] || { echo "test-chart: Python >= 3.12 is needed (helm-sdkpy); install python3.12" >&2; exit 1; }
VENV=.cache/chart-venv
REQS="helm-sdkpy==0.1.32 kubernetes-validate==1.37.0 PyYAML==6.0.4"
if [ ! -f "$VENV/.ready" ] || [ "$(cat "$VENV/.ready")" != "$REQS" ]; then
  echo "test-chart: installing $REQS into $VENV"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet $REQS
  echo "$REQS" > "$VENV/.ready"
fi
exec "$VENV/bin/python" helm/tests/test_chart.py "$GATEWAY"
