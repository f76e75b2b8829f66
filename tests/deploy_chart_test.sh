#!/usr/bin/env bash
# Checks the Helm chart and the manifests rendered from it; one CTest entry per case:
#   lint          helm lint --strict: default, GPU, secure values, secure + LoadBalancer +
#                 NetworkPolicy, and secure + a co-located runner with its token
#   validate      every object helm renders (default, GPU, secure, co-located runner, secure
#                 with a co-located runner, a published API with its NetworkPolicy) against
#                 the Kubernetes schemas
#   rejects       deploy/validate.mjs rejects each defect in deploy_invalid_manifests.yaml
#   up_to_date    deploy/k8s/ equals a fresh render of the chart
#   rules         the alerting rules (helm/kvrecall/files/kvrecall.rules.yaml): promtool check
#                 rules and test rules (tests/prometheus_rules_test.yaml), and the
#                 PrometheusRule the chart renders holds exactly the file's groups; the
#                 Grafana dashboard's ConfigMap holds exactly its JSON
#   values        derived values (memory budget, GPU limit, the co-located runner's socket,
#                 its plaintext socket and token under TLS and tokens,
#                 the metrics Service of a published API, the NetworkPolicy, integer flags
#                 from a values file) and the chart's refusals (its own checks and
#                 values.schema.json)
# Exits 77 (CTest's skip) when helm or the node packages are missing.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/../deploy/tools.sh"
case_name="${1:?usage: $0 lint|validate|rejects|up_to_date|rules|values}"

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

# expect_renders_file TEMPLATE VALUE FILE: with VALUE.enabled, templates/TEMPLATE holds FILE as it
# is: a rules file as its spec, a JSON file as its one data entry.
expect_renders_file() {
  local template="$1" value="$2" file="$3"
  "$HELM" template kvrecall "$chart_dir" --set "$value.enabled=true" \
      --show-only "templates/$template" \
    | /usr/bin/python3 -c '
import json, sys, yaml
rendered = yaml.safe_load(sys.stdin)
path, template = sys.argv[1], sys.argv[2]
with open(path) as f:
    if path.endswith(".json"):
        held, expected = json.loads(next(iter(rendered["data"].values()))), json.load(f)
    else:
        held, expected = rendered["spec"], yaml.safe_load(f)
if held != expected:
    sys.exit("templates/" + template + " does not hold " + path + " as it is")
' "$file" "$template" || fail "rendered $template"
  echo "ok: templates/$template holds $file"
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
    "$HELM" lint --strict "$chart_dir" -f "$chart_dir/values-secure.yaml"
    "$HELM" lint --strict "$chart_dir" -f "$chart_dir/values-secure.yaml" \
      --set service.type=LoadBalancer --set networkPolicy.enabled=true
    "$HELM" lint --strict "$chart_dir" -f "$chart_dir/values-secure.yaml" \
      --set colocatedRunner.enabled=true --set colocatedRunner.image=runner:1 \
      --set colocatedRunner.tokenSecretName=kvrecall-tokens --set colocatedRunner.tokenSecretKey=runner
    ;;
  validate)
    require_helm
    require_node_models
    for variant in default gpu secure; do
      rendered="$(render_chart "$variant")"
      echo "== $variant"
      "$NODE" "$deploy_root/deploy/validate.mjs" - <<<"$rendered"
      kinds=(StatefulSet Service ServiceAccount PodDisruptionBudget)
      [ "$variant" = secure ] && kinds+=(ServiceMonitor PrometheusRule ConfigMap)
      for kind in "${kinds[@]}"; do
        grep -q "^kind: $kind$" <<<"$rendered" || fail "$variant render has no $kind"
      done
    done
    echo "== colocated runner"
    "$HELM" template kvrecall "$chart_dir" --set colocatedRunner.enabled=true \
      --set colocatedRunner.image=runner:1 --set 'colocatedRunner.args={python3,-m,runner}' \
      | "$NODE" "$deploy_root/deploy/validate.mjs" -
    echo "== secure, colocated runner with its token"
    "$HELM" template kvrecall "$chart_dir" -f "$chart_dir/values-secure.yaml" \
      --set colocatedRunner.enabled=true --set colocatedRunner.image=runner:1 \
      --set colocatedRunner.tokenSecretName=kvrecall-tokens --set colocatedRunner.tokenSecretKey=runner \
      | "$NODE" "$deploy_root/deploy/validate.mjs" -
    # A published API (secure values, LoadBalancer) with its metrics Service and a NetworkPolicy
    # whose peers cover each kind (podSelector, namespaceSelector with podSelector, ipBlock).
    echo "== secure, LoadBalancer, NetworkPolicy"
    published="$("$HELM" template kvrecall "$chart_dir" -f "$chart_dir/values-secure.yaml" \
      --set service.type=LoadBalancer --set networkPolicy.enabled=true \
      --set 'networkPolicy.grpc.from[0].podSelector.matchLabels.app=runner' \
      --set 'networkPolicy.grpc.from[1].ipBlock.cidr=203.0.113.0/24' \
      --set 'networkPolicy.grpc.from[1].ipBlock.except[0]=203.0.113.7/32' \
      --set 'networkPolicy.metrics.from[0].podSelector.matchLabels.app=prometheus' \
      --set 'networkPolicy.metrics.from[0].namespaceSelector.matchLabels.name=monitoring')"
    "$NODE" "$deploy_root/deploy/validate.mjs" - <<<"$published"
    for kind in NetworkPolicy ServiceMonitor; do
      grep -q "^kind: $kind$" <<<"$published" || fail "published render has no $kind"
    done
    [ "$(grep -c '^kind: Service$' <<<"$published")" = 3 ] || fail "published render: expected 3 Services"
    echo "== NetworkPolicy with every port closed"
    "$HELM" template kvrecall "$chart_dir" --set networkPolicy.enabled=true \
      --set networkPolicy.grpc.from=null --set networkPolicy.metrics.from=null \
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
      "ServiceMonitor/misspelt-scrape-timeout: spec.endpoints.0.scrapeTimout: field not in the schema"
      "NetworkPolicy/misspelt-peer-selector: spec.ingress.0.from.0.podSelecter: field not in the schema"
      "9 objects checked, 9 invalid"
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
    expect_render_error "set resources.limits.memory: the host memory budget is server.hostMemoryBudget.fractionOfLimit of it" \
      --set resources.limits.memory=null
    # An explicit budget needs a limit all the same: nothing else keeps the pod below the node.
    expect_render_error "server.hostMemoryBudget.gib needs resources.limits.memory as well" \
      --set resources.limits.memory=null --set server.hostMemoryBudget.gib=4
    expect_render_error 'resources.limits.memory "8e9": use a plain quantity such as 8Gi, 8192Mi or 8G' \
      --set resources.limits.memory=8e9
    expect_render_error "server.hostMemoryBudget.fractionOfLimit must be in (0, 1), got 1.5" \
      --set server.hostMemoryBudget.fractionOfLimit=1.5
    # A budget that rounds down to 0.00 rendered --host_memory_budget_gb=0.00, which kvrecalld
    # reads as no budget at all (probe 20, 6).
    expect_render_error "rounds down to 0.00 GiB, which kvrecalld reads as no budget at all" \
      --set server.hostMemoryBudget.gib=0.005
    expect_render_error "rounds down to 0.00 GiB, which kvrecalld reads as no budget at all" \
      --set resources.limits.memory=12Mi
    [ "$(rendered_budget --set resources.limits.memory=13Mi)" = "0.01" ] || fail "13Mi budget, expected 0.01"
    # A tenant's share of the host budget: a fraction of it, rounded down, no flag when unset.
    tenant_share="$("$HELM" template kvrecall "$chart_dir" \
      --set server.hostMemoryBudget.perTenantFraction=0.25 \
      | sed -n 's/^ *- --host_memory_budget_per_tenant_gb=//p')"
    [ "$tenant_share" = "1.60" ] || fail "a quarter of the 6.40 GiB budget per tenant: got '$tenant_share'"
    if "$HELM" template kvrecall "$chart_dir" | grep -q -- '--host_memory_budget_per_tenant_gb'; then
      fail "the default render gives tenants a budget of their own"
    fi
    expect_render_error "the host memory budget per tenant (0.0064 GiB) rounds down to 0.00 GiB" \
      --set server.hostMemoryBudget.perTenantFraction=0.001
    expect_render_error "server.hostMemoryBudget.perTenantFraction must be in (0, 1], got 1.5" \
      --set server.hostMemoryBudget.perTenantFraction=1.5
    expect_render_error "server.extraArgs: --host_memory_budget_per_tenant_gb is set by the chart" \
      --set "server.extraArgs={--host_memory_budget_per_tenant_gb=1}"
    # Each GPU's budget and a tenant's share of it (GiB per device), with gpu.enabled only; a
    # budget of 0 is kvrecalld's "unlimited", a share of 0 would be "none" (left unset instead).
    gpu_flags="$("$HELM" template kvrecall "$chart_dir" --set gpu.enabled=true \
      --set gpu.memoryBudget.gib=70 --set-string gpu.memoryBudget.perTenantGib=12.5 \
      --show-only templates/statefulset.yaml | sed -nE 's/^ *- --(gpu_memory_budget[a-z_]*=.*)/\1/p')"
    [ "$gpu_flags" = $'gpu_memory_budget_gb=70\ngpu_memory_budget_per_tenant_gb=12.5' ] ||
      fail "gpu.memoryBudget 70 and 12.5: got '$gpu_flags'"
    grep -qx -- ' *- --gpu_memory_budget_gb=0' <<<"$("$HELM" template kvrecall "$chart_dir" \
      --set gpu.enabled=true --set gpu.memoryBudget.gib=0 --show-only templates/statefulset.yaml)" ||
      fail "gpu.memoryBudget.gib=0 (unlimited) rendered no flag"
    if "$HELM" template kvrecall "$chart_dir" --set gpu.enabled=true | grep -q -- '--gpu_memory'; then
      fail "the GPU render without gpu.memoryBudget sets a GPU budget"
    fi
    grep -qx -- ' *- --gpu_memory_budget_gb=1.0000005e+06' <<<"$("$HELM" template kvrecall \
      "$chart_dir" --set gpu.enabled=true --set gpu.memoryBudget.gib=1000000.5 \
      --show-only templates/statefulset.yaml)" || fail "gpu.memoryBudget.gib=1000000.5 as kvrecalld reads it"
    # A release's values from before gpu.memoryBudget (helm upgrade --reuse-values) render.
    "$HELM" template kvrecall "$chart_dir" --set gpu.memoryBudget=null >/dev/null ||
      fail "values without gpu.memoryBudget do not render"
    expect_render_error "gpu.memoryBudget.perTenantGib is set but gpu.enabled is false" \
      --set gpu.memoryBudget.perTenantGib=4
    expect_render_error "gpu.memoryBudget.gib is set but gpu.enabled is false" \
      --set gpu.memoryBudget.gib=0
    expect_render_error "gpu.memoryBudget.gib must be 0 (unlimited) or from 0.01 to below 2^33 GiB, got 8589934592" \
      --set gpu.enabled=true --set-string gpu.memoryBudget.gib=8589934592
    expect_render_error "gpu.memoryBudget.perTenantGib must be from 0.01 to below 2^33 GiB, got 0" \
      --set gpu.enabled=true --set-string gpu.memoryBudget.perTenantGib=0
    expect_render_error "gpu.memoryBudget.perTenantGib (50) must not exceed gpu.memoryBudget.gib (0.1)" \
      --set gpu.enabled=true --set gpu.memoryBudget.gib=0.1 --set gpu.memoryBudget.perTenantGib=50
    expect_render_error "gpu.memoryBudget.gib must be 0 (unlimited) or from 0.01 to below 2^33 GiB, got 0.001" \
      --set gpu.enabled=true --set gpu.memoryBudget.gib=0.001
    expect_render_error "gpu.memoryBudget.perTenantGib must be from 0.01 to below 2^33 GiB, got 9999999999" \
      --set gpu.enabled=true --set-string gpu.memoryBudget.perTenantGib=9999999999
    expect_render_error "at '/gpu/memoryBudget/perTenantGib': exclusiveMinimum: got 0, want 0" \
      --set gpu.enabled=true --set gpu.memoryBudget.perTenantGib=0
    expect_render_error "server.extraArgs: --gpu_memory_budget_per_tenant_gb is set by the chart; use gpu.memoryBudget.perTenantGib (with gpu.enabled) instead" \
      --set "server.extraArgs={--gpu_memory_budget_per_tenant_gb=1}"
    # --flagfile (and Abseil's --fromenv, --tryfromenv) would set the flags the chart checks.
    expect_render_error "server.extraArgs: --flagfile would set flags past the chart's checks" \
      --set "server.extraArgs={--flagfile=/etc/kvrecalld.flags}"
    expect_render_error "server.extraArgs: --fromenv would set flags past the chart's checks" \
      --set "server.extraArgs={--fromenv=max_sessions}"
    # A fraction of a second from --set arrives as a string, as shutdownGraceSeconds' does.
    grep -q -- '--session_idle_ttl_seconds=2.5' <<<"$("$HELM" template kvrecall "$chart_dir" \
      --set server.sessionIdleTtlSeconds=2.5)" || fail "sessionIdleTtlSeconds=2.5 from --set"
    if "$HELM" template kvrecall "$chart_dir" --set-string server.sessionIdleTtlSeconds=0 \
        | grep -q -- '--session_idle_ttl_seconds'; then
      fail "sessionIdleTtlSeconds=0 from --set-string rendered a flag (0 is no TTL)"
    fi
    expect_render_error "server.extraArgs: --max_message_mb is set by the chart; use server.maxMessageMb instead" \
      --set "server.extraArgs={--max_message_mb=8}"
    # Every flag the chart renders is refused in extraArgs, naming the values that set it (a flag
    # added to kvrecall.args without an entry in kvrecall.chartFlagOwners would be taken twice,
    # kvrecalld keeping extraArgs', the last). The flags are read from kvrecall.args' source, and
    # `every_flag` must turn each of them on, so that a new one behind a value it does not set
    # fails here rather than going unchecked.
    helpers="$chart_dir/templates/_helpers.tpl"
    source_flags="$(sed -n '/define "kvrecall.args"/,/range .Values.server.extraArgs/p' "$helpers" \
      | sed -nE 's/^- --([a-z_]+).*/\1/p' | sort -u)"
    every_flag=(--set tls.enabled=true --set tls.secretName=s --set tls.clientAuth=true
      --set auth.tokenSecretName=a --set metrics.tls.enabled=true --set metrics.tokenSecretName=m
      --set colocatedRunner.enabled=true --set colocatedRunner.image=runner:1
      --set colocatedRunner.tokenSecretName=r --set colocatedRunner.sharedMemory.enabled=true
      --set server.workerThreads=4 --set server.maxSessions=2 --set server.maxSessionsPerTenant=1
      --set server.maxContextTokens=1000 --set server.sessionIdleTtlSeconds=5
      --set server.hostMemoryBudget.perTenantFraction=0.5 --set gpu.enabled=true
      --set gpu.memoryBudget.gib=70 --set gpu.memoryBudget.perTenantGib=8)
    rendered_flags="$("$HELM" template kvrecall "$chart_dir" "${every_flag[@]}" \
      --show-only templates/statefulset.yaml \
      | sed -nE 's/^ +- "?--([a-z_]+).*/\1/p' | sort -u)" || fail "the chart with every flag set"
    [ -n "$source_flags" ] || fail "no flags read from kvrecall.args in $helpers"
    [ "$rendered_flags" = "$source_flags" ] ||
      fail "every_flag renders [$(echo $rendered_flags)], kvrecall.args has [$(echo $source_flags)]"
    for flag in $source_flags; do
      if [ "$flag" = plaintext_unix_sockets ]; then
        expected="server.extraArgs: --$flag is set by the chart: with colocatedRunner.enabled"
      else
        owner="$(sed -n '/define "kvrecall.chartFlagOwners"/,/^{{- end }}/p' "$helpers" \
          | sed -n "s/^$flag: //p")"
        [ -n "$owner" ] || fail "--$flag has no entry in kvrecall.chartFlagOwners"
        expected="server.extraArgs: --$flag is set by the chart; use $owner instead"
      fi
      expect_render_error "$expected" "${every_flag[@]}" --set "server.extraArgs={--$flag=1}"
    done
    # A bool's negative form names the flag too; the schema takes lowercase names alone, as
    # kvrecalld's flags are.
    expect_render_error "server.extraArgs: --nomax_sessions is set by the chart; use server.maxSessions instead" \
      --set "server.extraArgs={--nomax_sessions}"
    expect_render_error "at '/server/extraArgs/0': '--MAX_SESSIONS=5' does not match pattern" \
      --set "server.extraArgs={--MAX_SESSIONS=5}"
    expect_render_error "server.extraArgs: --tls_refresh_seconds is set by the chart; use tls.refreshSeconds (with tls.enabled) instead" \
      --set "server.extraArgs={--tls_refresh_seconds=5}"
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
    # sharedMemory (on by default with the runner): kvrecalld's regions in the socket directory,
    # the runner told so, the tmpfs sized for them; off: none of it.
    for line in '- --shared_memory_dir=/sock' '- --max_shared_streams=16' \
        'name: KVRECALL_SHARED_MEMORY' 'sizeLimit: 256Mi'; do
      grep -qF -- "$line" <<<"$colocated" || fail "colocated render: no '$line'"
    done
    no_shm="$("$HELM" template kvrecall "$chart_dir" --set colocatedRunner.enabled=true \
      --set colocatedRunner.image=runner:1 --set colocatedRunner.sharedMemory.enabled=false)"
    if grep -qE 'shared_memory|KVRECALL_SHARED_MEMORY' <<<"$no_shm"; then
      fail "colocated render with sharedMemory.enabled=false still serves shared memory"
    fi
    grep -qF 'sizeLimit: 1Mi' <<<"$no_shm" || fail "colocated render without sharedMemory: emptyDir not 1Mi"
    expect_render_error "at '/colocatedRunner/sharedMemory/sizeLimit': '1GB' does not match pattern" \
      --set colocatedRunner.enabled=true --set colocatedRunner.image=r --set colocatedRunner.sharedMemory.sizeLimit=1GB
    expect_render_error "server.extraArgs: --shared_memory_dir is set by the chart" \
      --set "server.extraArgs={--shared_memory_dir=/tmp}"
    expect_render_error "colocatedRunner.image: set the runner's image" --set colocatedRunner.enabled=true
    expect_render_error "colocatedRunner.name: kvrecalld is the server's container" \
      --set colocatedRunner.enabled=true --set colocatedRunner.image=r --set colocatedRunner.name=kvrecalld
    expect_render_error "at '/colocatedRunner/socketDir': 'run/kvrecall' does not match pattern" \
      --set colocatedRunner.enabled=true --set colocatedRunner.image=r --set colocatedRunner.socketDir=run/kvrecall
    # Metrics, TLS and tokens: the flags and mounts they derive, and what cannot work together.
    default_render="$("$HELM" template kvrecall "$chart_dir")"
    for line in '- --metrics_address=0.0.0.0:9090' 'prometheus.io/scrape: "true"' \
        'prometheus.io/port: "9090"' 'targetPort: metrics'; do
      grep -qF -- "$line" <<<"$default_render" || fail "default render lacks: $line"
    done
    if grep -qE 'ServiceMonitor|--tls_|--auth_token_file|--health_address' <<<"$default_render"; then
      fail "the default render enables TLS, tokens or a ServiceMonitor"
    fi
    no_metrics="$("$HELM" template kvrecall "$chart_dir" --set metrics.enabled=false)"
    grep -qF -- '- --metrics_address=' <<<"$no_metrics" || fail "metrics.enabled=false must pass an empty --metrics_address"
    if grep -qE 'prometheus.io|name: metrics|--metrics_address=0' <<<"$no_metrics"; then
      fail "metrics.enabled=false still exposes metrics"
    fi
    secure="$(render_chart secure)"
    for line in '- --tls_cert=/etc/kvrecall/tls/tls.crt' '- --tls_key=/etc/kvrecall/tls/tls.key' \
        '- --tls_client_ca=/etc/kvrecall/tls/ca.crt' '- --health_address=0.0.0.0:50052' \
        '- --auth_token_file=/etc/kvrecall/auth/tokens' 'secretName: kvrecall-tls' \
        'secretName: kvrecall-tokens' 'mountPath: /etc/kvrecall/tls' 'release: kube-prometheus-stack'; do
      grep -qF -- "$line" <<<"$secure" || fail "secure render lacks: $line"
    done
    # The kubelet's gRPC probes speak plaintext: with TLS both go to the health-only port.
    [ "$(grep -cE '^ +port: 50052$' <<<"$secure")" = 2 ] || fail "secure render: probes must call port 50052"
    expect_render_error "tls.secretName: name the kubernetes.io/tls Secret" --set tls.enabled=true
    expect_render_error "tls.clientAuth (mutual TLS) needs tls.enabled" --set tls.clientAuth=true
    expect_render_error "auth.tokenSecretName needs tls.enabled: clients send bearer tokens only over TLS" \
      --set auth.tokenSecretName=tokens
    expect_render_error "metrics.serviceMonitor.enabled needs metrics.enabled" \
      --set metrics.enabled=false --set metrics.serviceMonitor.enabled=true
    expect_render_error "server.port, metrics.port and tls.probePort must differ, got [50051 50051]" \
      --set metrics.port=50051
    expect_render_error "server.port, metrics.port and tls.probePort must differ, got [50051 9090 9090]" \
      --set tls.enabled=true --set tls.secretName=s --set tls.probePort=9090
    expect_render_error "server.extraArgs: --tls_cert is set by the chart; use tls.enabled and tls.secretName instead" \
      --set "server.extraArgs={--tls_cert=/x}"
    expect_render_error "at '/metrics/serviceMonitor/interval': '15 seconds' does not match pattern" \
      --set "metrics.serviceMonitor.interval=15 seconds"
    # A NodePort or LoadBalancer Service publishes the API: only with TLS and tokens, and never
    # with the metrics port, which moves to a ClusterIP Service of its own.
    for type in LoadBalancer NodePort; do
      expect_render_error "service.type $type publishes the gRPC API outside the cluster: it needs tls.enabled (with tls.secretName) and auth.tokenSecretName" \
        --set service.type=$type
      expect_render_error "service.type $type publishes the gRPC API outside the cluster" \
        --set service.type=$type --set tls.enabled=true --set tls.secretName=s
    done
    published_args=(-f "$chart_dir/values-secure.yaml" --set service.type=LoadBalancer)
    published="$("$HELM" template kvrecall "$chart_dir" "${published_args[@]}")"
    public_service="$("$HELM" template kvrecall "$chart_dir" "${published_args[@]}" \
      --show-only templates/service.yaml)"
    grep -qF 'type: LoadBalancer' <<<"$public_service" || fail "published render: Service kvrecall is not the LoadBalancer"
    grep -qF 'name: grpc' <<<"$public_service" || fail "published render: the LoadBalancer has no grpc port"
    if grep -qE 'metrics|9090' <<<"$public_service"; then
      fail "published render: the metrics port is on the LoadBalancer Service: $public_service"
    fi
    metrics_service="$("$HELM" template kvrecall "$chart_dir" "${published_args[@]}" \
      --show-only templates/service-metrics.yaml)"
    grep -qF 'name: kvrecall-metrics' <<<"$metrics_service" || fail "published render: no Service kvrecall-metrics"
    for line in 'type: ClusterIP' 'name: metrics' 'port: 9090' 'targetPort: metrics'; do
      grep -qF -- "$line" <<<"$metrics_service" || fail "published render: Service kvrecall-metrics lacks '$line'"
    done
    grep -qF -- '- port: metrics' <<<"$published" || fail "published render: the ServiceMonitor lost its metrics port"
    if grep -q 'kvrecall-metrics' <<<"$default_render"; then
      fail "the default (ClusterIP) render has a separate metrics Service"
    fi
    # The optional NetworkPolicy: off by default; on, one rule per port with its peers.
    if grep -q '^kind: NetworkPolicy$' <<<"$default_render"; then
      fail "the default render has a NetworkPolicy"
    fi
    policy="$("$HELM" template kvrecall "$chart_dir" --set networkPolicy.enabled=true \
      --show-only templates/networkpolicy.yaml)"
    for line in 'kvrecall-client: "true"' 'kubernetes.io/metadata.name: monitoring' \
        '- port: 50051' '- port: 9090' '- Ingress'; do
      grep -qF -- "$line" <<<"$policy" || fail "NetworkPolicy render lacks '$line': $policy"
    done
    closed="$("$HELM" template kvrecall "$chart_dir" --set networkPolicy.enabled=true \
      --set networkPolicy.grpc.from=null --set networkPolicy.metrics.from=null \
      --show-only templates/networkpolicy.yaml)"
    grep -qF 'ingress: []' <<<"$closed" || fail "NetworkPolicy with no peers must close every port: $closed"
    tls_policy="$("$HELM" template kvrecall "$chart_dir" -f "$chart_dir/values-secure.yaml" \
      --set networkPolicy.enabled=true --set metrics.enabled=false --set metrics.serviceMonitor.enabled=false \
      --set metrics.prometheusRule.enabled=false --set metrics.grafanaDashboard.enabled=false \
      --set metrics.tokenSecretName= --set metrics.tls.enabled=false --show-only templates/networkpolicy.yaml)"
    grep -qF -- '- port: 50052' <<<"$tls_policy" || fail "NetworkPolicy with TLS: the health port is closed"
    if grep -qF -- '- port: 9090' <<<"$tls_policy"; then
      fail "NetworkPolicy without metrics still opens the metrics port"
    fi
    expect_render_error "at '/networkPolicy/grpc/from/0': additional properties 'podSelecter' not allowed" \
      --set networkPolicy.enabled=true --set 'networkPolicy.grpc.from[0].podSelecter.x=y'
    expect_render_error "at '/networkPolicy': additional properties 'ingress' not allowed" \
      --set networkPolicy.enabled=true --set 'networkPolicy.ingress=x'
    # TLS with a co-located runner: kvrecalld serves the runner's socket in plaintext
    # (--plaintext_unix_sockets) and the gRPC port in TLS; the runner gets no CA, certificate
    # or TLS Secret. (The combination was refused: the socket spoke the port's TLS.)
    if grep -qF -- '--plaintext_unix_sockets' <<<"$colocated"; then
      fail "colocated render without TLS passes --plaintext_unix_sockets"
    fi
    tls_runner="$("$HELM" template kvrecall "$chart_dir" --set tls.enabled=true --set tls.secretName=s \
      --set tls.clientAuth=true --set colocatedRunner.enabled=true --set colocatedRunner.image=runner:1)"
    for line in '- --plaintext_unix_sockets=true' '- --tls_cert=/etc/kvrecall/tls/tls.crt' \
        '- --tls_client_ca=/etc/kvrecall/tls/ca.crt' '- --address=0.0.0.0:50051,unix:/run/kvrecall/kvrecall.sock'; do
      grep -qF -- "$line" <<<"$tls_runner" || fail "TLS + colocated render lacks: $line"
    done
    [ "$(grep -c 'mountPath: /etc/kvrecall/tls$' <<<"$tls_runner")" = 1 ] \
      || fail "TLS + colocated render: the TLS Secret must be mounted in kvrecalld alone"
    if grep -qE 'KVRECALL_TOKEN_FILE|runner-token' <<<"$tls_runner"; then
      fail "TLS + colocated render without tokens gives the runner a token"
    fi
    # With tokens the socket checks them too: the runner's own token, from its own Secret key,
    # in its container alone; refused without one, and a runner token without a token file.
    secure_runner="$("$HELM" template kvrecall "$chart_dir" -f "$chart_dir/values-secure.yaml" \
      --set colocatedRunner.enabled=true --set colocatedRunner.image=runner:1 \
      --set colocatedRunner.tokenSecretName=runner-secret --set colocatedRunner.tokenSecretKey=runner)"
    for line in '- --plaintext_unix_sockets=true' '- --auth_token_file=/etc/kvrecall/auth/tokens' \
        'name: KVRECALL_TOKEN_FILE' 'value: "/etc/kvrecall/runner/runner"' 'secretName: runner-secret' \
        '- key: runner'; do
      grep -qF -- "$line" <<<"$secure_runner" || fail "secure + colocated render lacks: $line"
    done
    for mount in /etc/kvrecall/runner /etc/kvrecall/auth /etc/kvrecall/tls; do
      [ "$(grep -c "mountPath: $mount$" <<<"$secure_runner")" = 1 ] \
        || fail "secure + colocated render: $mount must be mounted in one container"
    done
    runner_container="$(sed -n '/^        - name: runner$/,/^      volumes:$/p' <<<"$secure_runner")"
    grep -qF 'mountPath: /etc/kvrecall/runner' <<<"$runner_container" \
      || fail "secure + colocated render: the runner does not mount its token"
    if grep -qE 'mountPath: /etc/kvrecall/(tls|auth)$' <<<"$runner_container"; then
      fail "secure + colocated render: the runner mounts kvrecalld's Secrets"
    fi
    expect_render_error "colocatedRunner.tokenSecretName: with auth.tokenSecretName, calls on the runner's Unix socket need a bearer token too" \
      -f "$chart_dir/values-secure.yaml" --set colocatedRunner.enabled=true --set colocatedRunner.image=runner:1
    expect_render_error "colocatedRunner.tokenSecretName needs auth.tokenSecretName: without a token file kvrecalld checks no token" \
      --set colocatedRunner.enabled=true --set colocatedRunner.image=runner:1 --set colocatedRunner.tokenSecretName=t
    expect_render_error "colocatedRunner.tokenSecretKey: the runner's token needs a key of its own, not auth.tokenSecretKey of the same Secret" \
      -f "$chart_dir/values-secure.yaml" --set colocatedRunner.enabled=true --set colocatedRunner.image=runner:1 \
      --set colocatedRunner.tokenSecretName=kvrecall-tokens --set colocatedRunner.tokenSecretKey=tokens
    expect_render_error "server.extraArgs: --plaintext_unix_sockets is set by the chart" \
      --set "server.extraArgs={--plaintext_unix_sockets}"
    expect_render_error "server.extraArgs: --plaintext_unix_sockets is set by the chart" \
      --set "server.extraArgs={--noplaintext_unix_sockets}"
    expect_render_error "at '/colocatedRunner/tokenSecretKey': 'a/b' does not match pattern" \
      --set colocatedRunner.tokenSecretKey=a/b
    # The metrics' bearer token (the secure values set it): kvrecalld reads it from its own
    # Secret's mount, the ServiceMonitor sends it; refused without metrics, or in extraArgs.
    secure="$("$HELM" template kvrecall "$chart_dir" -f "$chart_dir/values-secure.yaml")"
    for line in '- --metrics_token_file=/etc/kvrecall/metrics/token' \
        'mountPath: /etc/kvrecall/metrics' 'secretName: kvrecall-metrics-token' 'type: Bearer'; do
      grep -qF -- "$line" <<<"$secure" || fail "secure render lacks: $line"
    done
    monitor="$(sed -n '/^kind: ServiceMonitor$/,/^---$/p' <<<"$secure")"
    for line in 'name: kvrecall-metrics-token' 'key: token'; do
      grep -qF -- "$line" <<<"$monitor" || fail "the ServiceMonitor does not send the token: $line"
    done
    # kvrecalld's own key for a rotation (tokens one a line), the ServiceMonitor's unchanged.
    rotating="$("$HELM" template kvrecall "$chart_dir" -f "$chart_dir/values-secure.yaml" \
      --set metrics.serverTokensKey=server-tokens)"
    for line in '- --metrics_token_file=/etc/kvrecall/metrics/server-tokens' \
        '- key: server-tokens'; do
      grep -qF -- "$line" <<<"$rotating" || fail "render with metrics.serverTokensKey lacks: $line"
    done
    grep -qF 'key: token' <<<"$(sed -n '/^kind: ServiceMonitor$/,/^---$/p' <<<"$rotating")" \
      || fail "with metrics.serverTokensKey the ServiceMonitor must still send tokenSecretKey"
    if "$HELM" template kvrecall "$chart_dir" | grep -qE 'metrics_token_file|metrics-token'; then
      fail "the default render asks scrapes for a token"
    fi
    expect_render_error "metrics.tokenSecretName needs metrics.enabled" \
      --set metrics.enabled=false --set metrics.tokenSecretName=t
    expect_render_error "server.extraArgs: --metrics_token_file is set by the chart" \
      --set "server.extraArgs={--metrics_token_file=/x}"
    # HTTPS on the metrics port (the secure values turn it on): kvrecalld serves the gRPC port's
    # certificate there, the ServiceMonitor scrapes https checking it against the Secret's
    # ca.crt for the API Service's name, the pods say https; refused without TLS or metrics.
    grep -qF -- '- --tls_refresh_seconds=60' <<<"$secure" || fail "secure render: the TLS files are not read again"
    grep -qF -- '- --tls_refresh_seconds=0' <<<"$("$HELM" template kvrecall "$chart_dir" \
      -f "$chart_dir/values-secure.yaml" --set tls.refreshSeconds=0)" || fail "tls.refreshSeconds=0 not passed"
    for line in '- --metrics_tls_cert=/etc/kvrecall/tls/tls.crt' \
        '- --metrics_tls_key=/etc/kvrecall/tls/tls.key' 'prometheus.io/scheme: https'; do
      grep -qF -- "$line" <<<"$secure" || fail "secure render lacks: $line"
    done
    for line in 'scheme: https' 'name: kvrecall-tls' 'key: ca.crt' 'serverName: kvrecall.default.svc'; do
      grep -qF -- "$line" <<<"$monitor" || fail "the ServiceMonitor does not scrape https: $line"
    done
    named="$("$HELM" template kvrecall "$chart_dir" -f "$chart_dir/values-secure.yaml" \
      --set metrics.tls.serverName=metrics.example.test --show-only templates/servicemonitor.yaml)"
    grep -qF 'serverName: metrics.example.test' <<<"$named" || fail "metrics.tls.serverName not used: $named"
    # The server's CA from a Secret of its own, where the TLS Secret's ca.crt is the clients'.
    server_ca="$("$HELM" template kvrecall "$chart_dir" -f "$chart_dir/values-secure.yaml" \
      --set metrics.tls.caSecretName=server-ca --set metrics.tls.caKey=issuer.pem \
      --show-only templates/servicemonitor.yaml)"
    for line in 'name: server-ca' 'key: issuer.pem'; do
      grep -qF -- "$line" <<<"$server_ca" || fail "metrics.tls.caSecretName/caKey not used: $line"
    done
    plain_monitor="$("$HELM" template kvrecall "$chart_dir" --set metrics.serviceMonitor.enabled=true \
      --show-only templates/servicemonitor.yaml)"
    grep -qF 'scheme: http' <<<"$plain_monitor" || fail "the default ServiceMonitor is not http"
    if grep -qE 'tlsConfig|scheme: https' <<<"$plain_monitor" \
        || "$HELM" template kvrecall "$chart_dir" | grep -qE 'metrics_tls|prometheus.io/scheme'; then
      fail "the default render serves or scrapes the metrics over TLS"
    fi
    expect_render_error "metrics.tls.enabled needs tls.enabled: the metrics port serves the certificate of tls.secretName" \
      --set metrics.tls.enabled=true
    expect_render_error "metrics.tls.enabled needs metrics.enabled" \
      --set metrics.enabled=false --set metrics.tls.enabled=true
    expect_render_error "server.extraArgs: --metrics_tls_cert is set by the chart" \
      --set "server.extraArgs={--metrics_tls_cert=/x}"
    expect_render_error "at '/metrics/tls/serverName': 'a b' does not match pattern" \
      --set "metrics.tls.serverName=a b"
    # Integer flags from a values file: YAML numbers reach the templates as float64, which
    # prints 1000000 as 1e+06, a value kvrecalld's integer flags refuse.
    big_values="$(mktemp)"
    cat >"$big_values" <<'VALUES'
replicaCount: 1000000
terminationGracePeriodSeconds: 10000000
server:
  maxSessions: 1000000
  maxSessionsPerTenant: 1000000
  maxContextTokens: 1000000
  sessionIdleTtlSeconds: 1000000
  shutdownGraceSeconds: 2000000
probes:
  liveness:
    periodSeconds: 1000000
colocatedRunner:
  enabled: true
  image: runner:1
  sharedMemory:
    maxStreams: 1000000
podDisruptionBudget:
  maxUnavailable: 1000000
VALUES
    big="$("$HELM" template kvrecall "$chart_dir" -f "$big_values")"
    rm -f "$big_values"
    if grep -E '[0-9]e[+-]?[0-9]' <<<"$big"; then
      fail "a values file's 1000000 rendered with an exponent"
    fi
    for line in '- --max_sessions=1000000' '- --max_context_tokens=1000000' \
        '- --session_idle_ttl_seconds=1000000' '- --shutdown_grace_seconds=2000000' \
        '- --max_shared_streams=1000000' 'terminationGracePeriodSeconds: 10000000' \
        'replicas: 1000000' 'periodSeconds: 1000000' 'maxUnavailable: 1000000'; do
      grep -qF -- "$line" <<<"$big" || fail "values file with 1000000: no '$line'"
    done
    # Fractions stay fractions.
    grep -qF -- '- --shutdown_grace_seconds=2.5' <<<"$("$HELM" template kvrecall "$chart_dir" \
      --set server.shutdownGraceSeconds=2.5)" || fail "shutdownGraceSeconds 2.5 did not render as 2.5"
    expect_render_error "at '/server/workerThreads': maximum: got 1,025, want 1,024" \
      --set server.workerThreads=1025
    expect_render_error "at '/server/maxContextTokens': maximum: got 2.147483648" \
      --set server.maxContextTokens=2147483648
    # values.schema.json: unknown keys and out-of-range values are refused, not ignored.
    expect_render_error "at '': additional properties 'replicas' not allowed" --set replicas=3
    expect_render_error "at '/probes/readiness': additional properties 'sevice' not allowed" \
      --set probes.readiness.sevice=kvrecall.v1.KvRecall
    expect_render_error "at '/server/port': maximum: got 70,000, want 65,535" --set server.port=70000
    expect_render_error "at '/server/extraArgs/0': 'oops' does not match pattern" --set "server.extraArgs={oops}"
    ;;
  rules)
    command -v promtool >/dev/null || { echo "SKIP: promtool is not installed"; exit 77; }
    rules_file="$chart_dir/files/kvrecall.rules.yaml"
    promtool check rules "$rules_file"
    (cd "$here" && promtool test rules prometheus_rules_test.yaml)
    require_helm
    # The PrometheusRule holds the rules file, groups and all, and the dashboard's ConfigMap its
    # JSON (both as they are, their templates left to Prometheus and Grafana); neither renders
    # by default nor without metrics.
    expect_renders_file prometheusrule.yaml metrics.prometheusRule "$rules_file"
    expect_renders_file grafana-dashboard.yaml metrics.grafanaDashboard \
      "$chart_dir/files/kvrecall-dashboard.json"
    "$HELM" template kvrecall "$chart_dir" --set metrics.grafanaDashboard.enabled=true \
        --show-only templates/grafana-dashboard.yaml | grep -qF 'grafana_dashboard: "1"' \
      || fail "the dashboard's ConfigMap lacks the sidecar's label grafana_dashboard: \"1\""
    default_kinds="$("$HELM" template kvrecall "$chart_dir" | grep '^kind: ')"
    for kind in PrometheusRule ConfigMap; do
      if grep -q "^kind: $kind$" <<<"$default_kinds"; then fail "the default render has a $kind"; fi
    done
    for value in prometheusRule grafanaDashboard; do
      expect_render_error "metrics.$value.enabled needs metrics.enabled" \
        --set metrics.enabled=false --set "metrics.$value.enabled=true"
    done
    ;;
  *)
    fail "unknown case $case_name"
    ;;
esac
echo "PASS: deploy chart $case_name"
