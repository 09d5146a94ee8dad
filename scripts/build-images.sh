#!/usr/bin/env bash
# Builds the three images the Helm chart runs (switchyard-gateway, switchyard-engine,
# switchyard-shim) from docker/Dockerfile and pushes them to REGISTRY, tagged TAG (default:
# the chart's appVersion). Then: helm install ... --set image.registry=REGISTRY
# (and --set image.tag=TAG when it is not the appVersion).
#
# Usage: scripts/build-images.sh REGISTRY [TAG]     e.g. registry.example.com/ml
# Environment: DOCKER (default docker; podman works), PUSH=0 to build only.
set -euo pipefail
cd "$(dirname "$0")/.."
REGISTRY="${1:?usage: scripts/build-images.sh REGISTRY [TAG]}"
TAG="${2:-$(awk -F'"' '/^appVersion:/ {print $2}' helm/switchyard/Chart.yaml)}"
DOCKER="${DOCKER:-docker}"
command -v "$DOCKER" >/dev/null || { echo "build-images: $DOCKER not found (set DOCKER=podman?)" >&2; exit 1; }
for target in gateway engine shim; do
  image="$REGISTRY/switchyard-$target:$TAG"
  echo "build-images: $image"
  "$DOCKER" build -f docker/Dockerfile --target "$target" -t "$image" .
  if [ "${PUSH:-1}" != 0 ]; then "$DOCKER" push "$image"; fi
done
echo "build-images: done. helm install sy helm/switchyard --set image.registry=$REGISTRY --set image.tag=$TAG ..."
