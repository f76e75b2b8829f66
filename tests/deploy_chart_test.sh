#!/usr/bin/env bash
# Checks the Helm chart and the manifests rendered from it; one CTest entry per case:
#   lint          helm lint --strict, default values and values-gpu.yaml
#   validate      every object helm renders (default and GPU) against the Kubernetes schemas
#   rejects       deploy/validate.mjs rejects each defect in deploy_invalid_manifests.yaml
#   up_to_date    deploy/k8s/ equals a fresh render of the chart
#   values        derived values (memory budget, GPU limit, the co-located runner's socket)
#                 and the chart's refusals (its own checks and values.schema.json)
# Exits 77 (CTest's skip) when helm or the node packages are missing.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/../deploy/tools.sh"
case_name="${1:?usage: $0 lint|validate|rejects|up_to_date|values}"

fail() { echo "FAIL: $*" >&2; exit 1; }

# expect_render_error "expected message" helm-template-arguments...
expect_render_error() {
  local expected="$1" out
  shift
  if out="$("$HELM" template kvrecall "$chart_dir" "$@" 2>&1)"; then
    fail "helm template $* rendered, expected the error: $expected"
  fi
  grep -qF -- "$expected" <<<"$out" || fail "helm template $*: expected '$expected', got: $out"
  echo "ok: $* -> $expected"
}

# rendered_arg VARIANT-ARGS... prints the --host_memory_budget_gb value the chart renders.
rendered_budget() {
  "$HELM" template kvrecall "$chart_dir" "$@" | sed -n 's/^ *- --host_memory_budget_gb=//p'
}

case "$case_name" in
  lint)
    require_helm
    "$HELM" lint --strict "$chart_dir"
    "$HELM" lint --strict "$chart_dir" -f "$chart_dir/values-gpu.yaml"
    ;;
  validate)
    require_helm
    require_node_models
    for variant in default gpu; do
      rendered="$(render_chart "$variant")"
      echo "== $variant"
      "$NODE" "$deploy_root/deploy/validate.mjs" - <<<"$rendered"
      for kind in StatefulSet Service ServiceAccount PodDisruptionBudget; do
        grep -q "^kind: $kind$" <<<"$rendered" || fail "$variant render has no $kind"
      done
    done
    echo "== colocated runner"
    "$HELM" template kvrecall "$chart_dir" --set colocatedRunner.enabled=true \
      --set colocatedRunner.image=runner:1 --set 'colocatedRunner.args={python3,-m,runner}' \
      | "$NODE" "$deploy_root/deploy/validate.mjs" -
    ;;
  rejects)
    require_node_models
    fixture="$here/deploy_invalid_manifests.yaml"
    if out="$("$NODE" "$deploy_root/deploy/validate.mjs" "$fixture")"; then
      fail "validate.mjs accepted $fixture: $out"
    fi
    echo "$out"
    expected=(
      "Service/typo-in-port: spec.ports.0.appprotocol: field not in the schema"
      "StatefulSet/named-grpc-probe-port: data/spec/template/spec/containers/0/readinessProbe/grpc/port must be integer"
      "StatefulSet/misspelt-probe-action: spec.template.spec.containers.0.livenessProbe.grcp: field not in the schema"
      "Pod/bad-memory-quantity: data/spec/containers/0/resources/limits/memory must be number, data/spec/containers/0/resources/limits/memory must match format \"quantity\""
      "PodDisruptionBudget/pdb-without-selector-type: data/spec/selector must be object"
      "Widget/unknown-kind: no schema for v1 Widget in kubernetes-models"
      "ServiceAccount/?: metadata.name is missing"
      "7 objects checked, 7 invalid"
    )
    for line in "${expected[@]}"; do
      grep -qF -- "$line" <<<"$out" || fail "validate.mjs did not report: $line"
    done
    ;;
  up_to_date)
    require_helm
    "$deploy_root/deploy/render-manifests.sh" --check
    ;;
  values)
    require_helm
    # The budget is 0.8 of the memory limit in GiB, rounded down to two decimals.
    [ "$(rendered_budget)" = "6.40" ] || fail "default budget $(rendered_budget), expected 6.40 (0.8 x 8Gi)"
    [ "$(rendered_budget -f "$chart_dir/values-gpu.yaml")" = "51.20" ] || fail "GPU budget, expected 51.20"
    [ "$(rendered_budget --set resources.limits.memory=1500Mi)" = "1.17" ] || fail "1500Mi budget, expected 1.17"
    [ "$(rendered_budget --set resources.limits.memory=10G)" = "7.45" ] || fail "10G budget, expected 7.45"
    [ "$(rendered_budget --set server.hostMemoryBudget.gib=7.5)" = "7.50" ] || fail "explicit budget, expected 7.50"
    [ "$(rendered_budget --set server.hostMemoryBudget.fractionOfLimit=0.5)" = "4.00" ] || fail "half of 8Gi, expected 4.00"
    gpu_limit="$("$HELM" template kvrecall "$chart_dir" -f "$chart_dir/values-gpu.yaml" | grep -c '^ *nvidia.com/gpu: 1$')"
    [ "$gpu_limit" = 1 ] || fail "GPU render must carry one nvidia.com/gpu: 1 limit, found $gpu_limit"
    if "$HELM" template kvrecall "$chart_dir" | grep -q 'nvidia.com/gpu'; then
      fail "the default render asks for a GPU"
    fi
    # OMP_NUM_THREADS follows the CPU request, and without one is left to OpenMP.
    grep -q 'name: OMP_NUM_THREADS' <<<"$("$HELM" template kvrecall "$chart_dir")" \
      || fail "the default render does not set OMP_NUM_THREADS"
    if "$HELM" template kvrecall "$chart_dir" --set resources.requests.cpu=null | grep -q OMP_NUM_THREADS; then
      fail "OMP_NUM_THREADS is set without a CPU request (the downward API would give 0)"
    fi
    expect_render_error "server.hostMemoryBudget.gib (9) must be below resources.limits.memory (8Gi = 8 GiB)" \
      --set server.hostMemoryBudget.gib=9
    expect_render_error "set resources.limits.memory (the host memory budget is derived from it) or server.hostMemoryBudget.gib" \
      --set resources.limits.memory=null
    expect_render_error 'resources.limits.memory "8e9": use a plain quantity such as 8Gi, 8192Mi or 8G' \
      --set resources.limits.memory=8e9
    expect_render_error "server.hostMemoryBudget.fractionOfLimit must be in (0, 1), got 1.5" \
      --set server.hostMemoryBudget.fractionOfLimit=1.5
    expect_render_error "server.extraArgs: --max_message_mb is set by the chart; use its value under server.* instead" \
      --set "server.extraArgs={--max_message_mb=8}"
    expect_render_error "server.shutdownGraceSeconds (30) must be below terminationGracePeriodSeconds (30)" \
      --set server.shutdownGraceSeconds=30
    # colocatedRunner: a second container beside kvrecalld sharing an emptyDir with its socket.
    if "$HELM" template kvrecall "$chart_dir" | grep -qE 'unix:|kvrecall-socket|emptyDir'; then
      fail "the default render has a Unix socket or a volume"
    fi
    colocated="$("$HELM" template kvrecall "$chart_dir" --set colocatedRunner.enabled=true \
      --set colocatedRunner.image=runner:1 --set colocatedRunner.socketDir=/sock)"
    grep -qF -- '- --address=0.0.0.0:50051,unix:/sock/kvrecall.sock' <<<"$colocated" \
      || fail "colocated render: kvrecalld does not listen on the port and unix:/sock/kvrecall.sock"
    [ "$(grep -c 'mountPath: /sock$' <<<"$colocated")" = 2 ] \
      || fail "colocated render: both containers must mount the socket directory"
    grep -qF 'value: "unix:/sock/kvrecall.sock"' <<<"$colocated" \
      || fail "colocated render: the runner gets no KVRECALL_ADDRESS"
    grep -qE '^        - name: runner$' <<<"$colocated" || fail "colocated render: no runner container"
    expect_render_error "colocatedRunner.image: set the runner's image" --set colocatedRunner.enabled=true
    expect_render_error "at '/colocatedRunner/socketDir': 'run/kvrecall' does not match pattern" \
      --set colocatedRunner.enabled=true --set colocatedRunner.image=r --set colocatedRunner.socketDir=run/kvrecall
    # values.schema.json: unknown keys and out-of-range values are refused, not ignored.
    expect_render_error "at '': additional properties 'replicas' not allowed" --set replicas=3
    expect_render_error "at '/probes/readiness': additional properties 'sevice' not allowed" \
      --set probes.readiness.sevice=kvrecall.v1.KvRecall
    expect_render_error "at '/server/port': maximum: got 70,000, want 65,535" --set server.port=70000
    expect_render_error "at '/server/extraArgs/0': 'oops' does not match pattern" --set "server.extraArgs={oops}"
    ;;
  *)
    fail "unknown case $case_name"
    ;;
esac
echo "PASS: deploy chart $case_name"
