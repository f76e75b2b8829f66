#!/usr/bin/env bash
# Renders the Helm chart into deploy/k8s/ (plain manifests for clusters without Helm), or with
# --check, fails when the committed manifests differ from a fresh render.
set -euo pipefail
source "$(dirname "$0")/tools.sh"
require_helm
check=0
[ "${1:-}" = --check ] && check=1

out_dir="$deploy_root/deploy/k8s"
status=0
for variant in default gpu; do
  if [ "$variant" = gpu ]; then
    file="$out_dir/kvrecall-gpu.yaml" source_note=" with values-gpu.yaml"
  else
    file="$out_dir/kvrecall.yaml" source_note=""
  fi
  fresh="$(mktemp)"
  {
    echo "# Rendered from deploy/helm/kvrecall${source_note} by deploy/render-manifests.sh;"
    echo "# do not edit (change the chart and render again). Apply: kubectl apply -n NAMESPACE -f $(basename "$file")"
    echo "# after pointing the StatefulSet's image at your registry: no registry holds the local tag"
    echo "# below (or apply, then kubectl set image statefulset/kvrecall kvrecalld=REGISTRY/kvrecalld:TAG)."
    render_chart "$variant"
  } >"$fresh"
  if [ "$check" -eq 1 ]; then
    if ! diff -u "$file" "$fresh"; then
      echo "deploy/k8s/$(basename "$file") is out of date: run deploy/render-manifests.sh" >&2
      status=1
    fi
    rm -f "$fresh"
  else
    mkdir -p "$out_dir"
    mv "$fresh" "$file" && chmod 644 "$file"
    echo "wrote deploy/k8s/$(basename "$file")"
  fi
done
exit "$status"
