{{/* Names, labels and the kvrecalld command line shared by the chart's templates. */}}

{{- define "kvrecall.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's full name; the headless Service appends "-headless", so keep room for it. */}}
{{- define "kvrecall.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 54 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 54 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 54 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvrecall.headlessServiceName" -}}
{{- printf "%s-headless" (include "kvrecall.fullname" .) }}
{{- end }}

{{- define "kvrecall.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvrecall.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvrecall.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvrecall.labels" -}}
helm.sh/chart: {{ include "kvrecall.chart" . }}
{{ include "kvrecall.selectorLabels" . }}
app.kubernetes.io/component: server
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "kvrecall.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvrecall.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvrecall.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
A Kubernetes memory quantity ("8Gi", "512Mi", "8G", "8589934592") in bytes, as a float.
Fails on forms the chart does not read (exponents, milli-bytes) rather than guessing.
*/}}
{{- define "kvrecall.quantityBytes" -}}
{{- $q := toString . }}
{{- if not (regexMatch "^[0-9]+(\\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$" $q) }}
{{- fail (printf "resources.limits.memory %q: use a plain quantity such as 8Gi, 8192Mi or 8G" $q) }}
{{- end }}
{{- $number := regexFind "^[0-9]+(\\.[0-9]+)?" $q }}
{{- $unit := trimPrefix $number $q }}
{{- $scale := dict "" 1 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 }}
{{- mulf (float64 $number) (index $scale $unit) }}
{{- end }}

{{/*
--host_memory_budget_gb in GiB with two decimals, rounded down: server.hostMemoryBudget.gib
when set, else fractionOfLimit of resources.limits.memory. Either way it must stay below the
memory limit, or the kernel would kill the pod before the budget refuses a request; so a
memory limit is required, with or without gib.
*/}}
{{- define "kvrecall.hostMemoryBudgetGiB" -}}
{{- $budget := .Values.server.hostMemoryBudget }}
{{- $limit := dig "limits" "memory" "" .Values.resources }}
{{- if not $limit }}
{{- if $budget.gib }}
{{- fail "server.hostMemoryBudget.gib needs resources.limits.memory as well: the budget must stay below a memory limit, or the node's OOM killer (not RESOURCE_EXHAUSTED) ends every session when memory runs short" }}
{{- end }}
{{- fail "set resources.limits.memory: the host memory budget is server.hostMemoryBudget.fractionOfLimit of it, or server.hostMemoryBudget.gib below it" }}
{{- end }}
{{- $limitGiB := divf (include "kvrecall.quantityBytes" $limit) 1073741824 }}
{{- $gib := 0.0 }}
{{- if $budget.gib }}
{{- $gib = float64 $budget.gib }}
{{- else }}
{{- $fraction := float64 $budget.fractionOfLimit }}
{{- if or (le $fraction 0.0) (ge $fraction 1.0) }}
{{- fail (printf "server.hostMemoryBudget.fractionOfLimit must be in (0, 1), got %v" $budget.fractionOfLimit) }}
{{- end }}
{{- $gib = mulf $limitGiB $fraction }}
{{- end }}
{{- if le $gib 0.0 }}
{{- fail (printf "the host memory budget must be positive, got %v GiB" $gib) }}
{{- end }}
{{- if ge $gib $limitGiB }}
{{- fail (printf "server.hostMemoryBudget.gib (%v) must be below resources.limits.memory (%s = %v GiB)" $gib $limit $limitGiB) }}
{{- end }}
{{- /* Rendered in hundredths of a GiB, rounded down to stay below the limit; kvrecalld reads 0
       as no budget at all, so a budget that rounds to 0 is refused here (probe 20, 6). */}}
{{- $rendered := divf (floor (mulf $gib 100)) 100 }}
{{- if le $rendered 0.0 }}
{{- fail (printf "the host memory budget (%v GiB) rounds down to 0.00 GiB, which kvrecalld reads as no budget at all: give at least 0.01 GiB (server.hostMemoryBudget, resources.limits.memory)" $gib) }}
{{- end }}
{{- printf "%.2f" $rendered }}
{{- end }}

{{/*
--host_memory_budget_per_tenant_gb in GiB with two decimals, rounded down:
server.hostMemoryBudget.perTenantFraction of the host memory budget (empty when unset).
*/}}
{{- define "kvrecall.hostMemoryBudgetPerTenantGiB" -}}
{{- $fraction := .Values.server.hostMemoryBudget.perTenantFraction }}
{{- if not (kindIs "invalid" $fraction) }}
{{- $share := float64 $fraction }}
{{- if or (le $share 0.0) (gt $share 1.0) }}
{{- fail (printf "server.hostMemoryBudget.perTenantFraction must be in (0, 1], got %v" $fraction) }}
{{- end }}
{{- $gib := mulf (float64 (include "kvrecall.hostMemoryBudgetGiB" .)) $share }}
{{- $rendered := divf (floor (mulf $gib 100)) 100 }}
{{- if le $rendered 0.0 }}
{{- fail (printf "the host memory budget per tenant (%v GiB) rounds down to 0.00 GiB, which kvrecalld reads as none: give at least 0.01 GiB (server.hostMemoryBudget.perTenantFraction)" $gib) }}
{{- end }}
{{- printf "%.2f" $rendered }}
{{- end }}
{{- end }}

{{/*
--gpu_memory_budget_gb or --gpu_memory_budget_per_tenant_gb in GiB per device (empty when
unset), given (list $ "gib") or (list $ "perTenantGib"): gpu.memoryBudget's value, with
gpu.enabled only.
*/}}
{{- define "kvrecall.gpuMemoryBudgetGiB" -}}
{{- $root := index . 0 }}
{{- $key := index . 1 }}
{{- /* dig: a release's old values (helm upgrade --reuse-values) have no gpu.memoryBudget. */}}
{{- $gib := dig "memoryBudget" $key nil $root.Values.gpu }}
{{- if not (kindIs "invalid" $gib) }}
{{- if not $root.Values.gpu.enabled }}
{{- fail (printf "gpu.memoryBudget.%s is set but gpu.enabled is false: the pod has no GPU to budget" $key) }}
{{- end }}
{{- /* kvrecalld reads 0 as unlimited (the budget) or none (the share), and refuses a budget below a byte or from 2^33 GiB: 0 where that is meant, else 0.01 up to that. */}}
{{- $in_range := and (ge (float64 $gib) 0.01) (lt (float64 $gib) 8589934592.0) }}
{{- if not (or $in_range (and (eq (float64 $gib) 0.0) (eq $key "gib"))) }}
{{- fail (printf "gpu.memoryBudget.%s must be %sfrom 0.01 to below 2^33 GiB, got %v" $key (ternary "0 (unlimited) or " "" (eq $key "gib")) $gib) }}
{{- end }}
{{- $budget := dig "memoryBudget" "gib" nil $root.Values.gpu }}
{{- if and (eq $key "perTenantGib") (not (kindIs "invalid" $budget)) }}
{{- if and (gt (float64 $budget) 0.0) (gt (float64 $gib) (float64 $budget)) }}
{{- fail (printf "gpu.memoryBudget.perTenantGib (%v) must not exceed gpu.memoryBudget.gib (%v): a share is within the device's budget" $gib $budget) }}
{{- end }}
{{- end }}
{{- include "kvrecall.number" $gib }}
{{- end }}
{{- end }}

{{/* The Unix socket a co-located runner reaches kvrecalld on (colocatedRunner). */}}
{{- define "kvrecall.socketAddress" -}}
unix:{{ .Values.colocatedRunner.socketDir }}/kvrecall.sock
{{- end }}

{{/*
Where the TLS and token Secrets are mounted in the kvrecalld container, and the runner's token
Secret in the co-located runner's.
*/}}
{{- define "kvrecall.tlsDir" -}}/etc/kvrecall/tls{{- end }}
{{- define "kvrecall.authDir" -}}/etc/kvrecall/auth{{- end }}
{{- define "kvrecall.runnerTokenDir" -}}/etc/kvrecall/runner{{- end }}
{{- define "kvrecall.metricsTokenDir" -}}/etc/kvrecall/metrics{{- end }}
{{/* The key of the metrics token's Secret that kvrecalld reads. */}}
{{- define "kvrecall.metricsServerTokensKey" -}}
{{- default .Values.metrics.tokenSecretKey .Values.metrics.serverTokensKey }}
{{- end }}

{{/* The port the probes call: the plaintext health port with TLS, else the gRPC port. */}}
{{- define "kvrecall.probePort" -}}
{{- if .Values.tls.enabled }}{{ int64 .Values.tls.probePort }}{{ else }}{{ int64 .Values.server.port }}{{ end }}
{{- end }}

{{/*
A number from values as a flag value without an exponent. A values file's numbers reach the
templates as float64, which prints 1000000 as 1e+06 (kvrecalld's integer flags refuse that):
a whole number prints through int64, a fraction as it is.
*/}}
{{- define "kvrecall.number" -}}
{{- $f := float64 . }}
{{- if eq $f (float64 (int64 $f)) }}{{ int64 $f }}{{ else }}{{ $f }}{{ end }}
{{- end }}

{{/*
The chart's own Service for the API is published outside the cluster (NodePort, LoadBalancer).
The metrics port is then on a Service of its own, of type ClusterIP, never on that one.
*/}}
{{- define "kvrecall.serviceIsPublic" -}}
{{- if ne .Values.service.type "ClusterIP" }}true{{ end }}
{{- end }}
{{- define "kvrecall.metricsServiceName" -}}
{{- if include "kvrecall.serviceIsPublic" . }}{{ printf "%s-metrics" (include "kvrecall.fullname" .) }}{{ else }}{{ include "kvrecall.fullname" . }}{{ end }}
{{- end }}

{{/*
The Service, metrics, TLS, token and runner values that cannot work together are refused. A
co-located runner goes with TLS (its socket is plaintext: --plaintext_unix_sockets), but with
tokens only when it is given one.
*/}}
{{- define "kvrecall.checkOperateValues" -}}
{{- if and (include "kvrecall.serviceIsPublic" .) (not (and .Values.tls.enabled .Values.auth.tokenSecretName)) }}
{{- fail (printf "service.type %s publishes the gRPC API outside the cluster: it needs tls.enabled (with tls.secretName) and auth.tokenSecretName (bearer tokens), else anyone who reaches it can list, drive and close every session. Keep service.type ClusterIP (kubectl port-forward reaches it from outside) or set both" .Values.service.type) }}
{{- end }}
{{- if .Values.colocatedRunner.enabled }}
{{- if and .Values.auth.tokenSecretName (not .Values.colocatedRunner.tokenSecretName) }}
{{- fail "colocatedRunner.tokenSecretName: with auth.tokenSecretName, calls on the runner's Unix socket need a bearer token too (the socket goes without TLS, not without the token check); name a Secret whose key colocatedRunner.tokenSecretKey (token) holds the runner's token (one that auth.tokenSecretName's file lists)" }}
{{- end }}
{{- if and .Values.colocatedRunner.tokenSecretName (not .Values.auth.tokenSecretName) }}
{{- fail "colocatedRunner.tokenSecretName needs auth.tokenSecretName: without a token file kvrecalld checks no token" }}
{{- end }}
{{- if and .Values.colocatedRunner.tokenSecretName (eq .Values.colocatedRunner.tokenSecretName .Values.auth.tokenSecretName) (eq .Values.colocatedRunner.tokenSecretKey .Values.auth.tokenSecretKey) }}
{{- fail "colocatedRunner.tokenSecretKey: the runner's token needs a key of its own, not auth.tokenSecretKey of the same Secret, which would mount every tenant's token in the runner" }}
{{- end }}
{{- end }}
{{- if and .Values.tls.enabled (not .Values.tls.secretName) }}
{{- fail "tls.secretName: name the kubernetes.io/tls Secret (tls.crt, tls.key; ca.crt for tls.clientAuth) when tls.enabled is true" }}
{{- end }}
{{- if and .Values.tls.clientAuth (not .Values.tls.enabled) }}
{{- fail "tls.clientAuth (mutual TLS) needs tls.enabled" }}
{{- end }}
{{- if and .Values.auth.tokenSecretName (not .Values.tls.enabled) }}
{{- fail "auth.tokenSecretName needs tls.enabled: clients send bearer tokens only over TLS" }}
{{- end }}
{{- if and .Values.metrics.serviceMonitor.enabled (not .Values.metrics.enabled) }}
{{- fail "metrics.serviceMonitor.enabled needs metrics.enabled" }}
{{- end }}
{{- if and .Values.metrics.prometheusRule.enabled (not .Values.metrics.enabled) }}
{{- fail "metrics.prometheusRule.enabled needs metrics.enabled" }}
{{- end }}
{{- if and .Values.metrics.tokenSecretName (not .Values.metrics.enabled) }}
{{- fail "metrics.tokenSecretName needs metrics.enabled" }}
{{- end }}
{{- if and .Values.metrics.tls.enabled (not .Values.metrics.enabled) }}
{{- fail "metrics.tls.enabled needs metrics.enabled" }}
{{- end }}
{{- if and .Values.metrics.tls.enabled (not .Values.tls.enabled) }}
{{- fail "metrics.tls.enabled needs tls.enabled: the metrics port serves the certificate of tls.secretName" }}
{{- end }}
{{- if and .Values.metrics.grafanaDashboard.enabled (not .Values.metrics.enabled) }}
{{- fail "metrics.grafanaDashboard.enabled needs metrics.enabled" }}
{{- end }}
{{- $ports := list (int .Values.server.port) }}
{{- if .Values.metrics.enabled }}{{ $ports = append $ports (int .Values.metrics.port) }}{{ end }}
{{- if .Values.tls.enabled }}{{ $ports = append $ports (int .Values.tls.probePort) }}{{ end }}
{{- if ne (len $ports) (len (uniq $ports)) }}
{{- fail (printf "server.port, metrics.port and tls.probePort must differ, got %v" $ports) }}
{{- end }}
{{- end }}

{{/*
The flags kvrecall.args sets, each with the values that set it: server.extraArgs may not give
them again (kvrecalld would take the last, past the chart's checks), and a render that finds one
there names what to set instead. deploy/README.md's "Flags" lists the same.
*/}}
{{- define "kvrecall.chartFlagOwners" -}}
address: server.port (and colocatedRunner.enabled for its Unix socket)
worker_threads: server.workerThreads
max_message_mb: server.maxMessageMb
host_memory_budget_gb: server.hostMemoryBudget.fractionOfLimit or server.hostMemoryBudget.gib
host_memory_budget_per_tenant_gb: server.hostMemoryBudget.perTenantFraction
gpu_memory_budget_gb: gpu.memoryBudget.gib (with gpu.enabled)
gpu_memory_budget_per_tenant_gb: gpu.memoryBudget.perTenantGib (with gpu.enabled)
shutdown_grace_seconds: server.shutdownGraceSeconds
max_sessions: server.maxSessions
max_sessions_per_tenant: server.maxSessionsPerTenant
max_context_tokens: server.maxContextTokens
session_idle_ttl_seconds: server.sessionIdleTtlSeconds
metrics_address: metrics.enabled and metrics.port
metrics_token_file: metrics.tokenSecretName (with metrics.enabled)
metrics_tls_cert: metrics.tls.enabled (with metrics.enabled and tls.enabled; the certificate is tls.secretName's)
metrics_tls_key: metrics.tls.enabled (with metrics.enabled and tls.enabled; the key is tls.secretName's)
tls_cert: tls.enabled and tls.secretName
tls_key: tls.enabled and tls.secretName
tls_client_ca: tls.clientAuth (with tls.enabled)
health_address: tls.probePort (with tls.enabled)
tls_refresh_seconds: tls.refreshSeconds (with tls.enabled)
auth_token_file: auth.tokenSecretName and auth.tokenSecretKey
shared_memory_dir: colocatedRunner.enabled and colocatedRunner.sharedMemory.enabled (in colocatedRunner.socketDir)
max_shared_streams: colocatedRunner.sharedMemory.maxStreams (with colocatedRunner.enabled and colocatedRunner.sharedMemory.enabled)
{{- end }}

{{/* kvrecalld's command line (the container's args; the image's entrypoint is kvrecalld). */}}
{{- define "kvrecall.args" -}}
- --address=0.0.0.0:{{ int64 .Values.server.port }}{{ if .Values.colocatedRunner.enabled }},{{ include "kvrecall.socketAddress" . }}{{ end }}
{{- if .Values.server.workerThreads }}
- --worker_threads={{ int64 .Values.server.workerThreads }}
{{- end }}
- --max_message_mb={{ int64 .Values.server.maxMessageMb }}
{{- if and .Values.colocatedRunner.enabled .Values.colocatedRunner.sharedMemory.enabled }}
- --shared_memory_dir={{ .Values.colocatedRunner.socketDir }}
- --max_shared_streams={{ int64 .Values.colocatedRunner.sharedMemory.maxStreams }}
{{- end }}
- --host_memory_budget_gb={{ include "kvrecall.hostMemoryBudgetGiB" . }}
{{- with include "kvrecall.hostMemoryBudgetPerTenantGiB" . }}
- --host_memory_budget_per_tenant_gb={{ . }}
{{- end }}
{{- with include "kvrecall.gpuMemoryBudgetGiB" (list . "gib") }}
- --gpu_memory_budget_gb={{ . }}
{{- end }}
{{- with include "kvrecall.gpuMemoryBudgetGiB" (list . "perTenantGib") }}
- --gpu_memory_budget_per_tenant_gb={{ . }}
{{- end }}
{{- if ge (float64 .Values.server.shutdownGraceSeconds) (float64 .Values.terminationGracePeriodSeconds) }}
{{- fail (printf "server.shutdownGraceSeconds (%v) must be below terminationGracePeriodSeconds (%v): the kubelet kills the container then" .Values.server.shutdownGraceSeconds .Values.terminationGracePeriodSeconds) }}
{{- end }}
- --shutdown_grace_seconds={{ include "kvrecall.number" .Values.server.shutdownGraceSeconds }}
{{- if .Values.server.maxSessions }}
- --max_sessions={{ int64 .Values.server.maxSessions }}
{{- end }}
{{- if .Values.server.maxSessionsPerTenant }}
- --max_sessions_per_tenant={{ int64 .Values.server.maxSessionsPerTenant }}
{{- end }}
{{- if .Values.server.maxContextTokens }}
- --max_context_tokens={{ int64 .Values.server.maxContextTokens }}
{{- end }}
{{- /* As a number: --set-string's "0" is a non-empty string, not the 0 that means no TTL. */}}
{{- if ne (float64 .Values.server.sessionIdleTtlSeconds) 0.0 }}
- --session_idle_ttl_seconds={{ include "kvrecall.number" .Values.server.sessionIdleTtlSeconds }}
{{- end }}
{{- include "kvrecall.checkOperateValues" . }}
- --metrics_address={{ if .Values.metrics.enabled }}0.0.0.0:{{ int64 .Values.metrics.port }}{{ end }}
{{- if .Values.tls.enabled }}
- --tls_cert={{ include "kvrecall.tlsDir" . }}/tls.crt
- --tls_key={{ include "kvrecall.tlsDir" . }}/tls.key
{{- if .Values.tls.clientAuth }}
- --tls_client_ca={{ include "kvrecall.tlsDir" . }}/ca.crt
{{- end }}
- --health_address=0.0.0.0:{{ int64 .Values.tls.probePort }}
- --tls_refresh_seconds={{ int64 .Values.tls.refreshSeconds }}
{{- if .Values.colocatedRunner.enabled }}
- --plaintext_unix_sockets=true
{{- end }}
{{- end }}
{{- if .Values.auth.tokenSecretName }}
- --auth_token_file={{ include "kvrecall.authDir" . }}/{{ .Values.auth.tokenSecretKey }}
{{- end }}
{{- if and .Values.metrics.enabled .Values.metrics.tls.enabled }}
- --metrics_tls_cert={{ include "kvrecall.tlsDir" . }}/tls.crt
- --metrics_tls_key={{ include "kvrecall.tlsDir" . }}/tls.key
{{- end }}
{{- if and .Values.metrics.enabled .Values.metrics.tokenSecretName }}
- --metrics_token_file={{ include "kvrecall.metricsTokenDir" . }}/{{ include "kvrecall.metricsServerTokensKey" . }}
{{- end }}
{{- range .Values.server.extraArgs }}
{{- $flag := regexFind "^--?[A-Za-z0-9_]+" (toString .) }}
{{- $name := trimPrefix "-" (trimPrefix "-" $flag) }}
{{- if has $name (list "plaintext_unix_sockets" "noplaintext_unix_sockets") }}
{{- fail "server.extraArgs: --plaintext_unix_sockets is set by the chart: with colocatedRunner.enabled and tls.enabled the runner's Unix socket goes without TLS" }}
{{- end }}
{{- if has $name (list "flagfile" "fromenv" "tryfromenv") }}
{{- fail (printf "server.extraArgs: %s would set flags past the chart's checks (those it sets, and --plaintext_unix_sockets); give each flag in server.extraArgs instead" $flag) }}
{{- end }}
{{- /* A flag's --noNAME form names it too (kvrecalld would refuse it at start for a flag that is not a bool: a pod crashing in a loop instead of a render error). */}}
{{- $owners := include "kvrecall.chartFlagOwners" . | fromYaml }}
{{- $owner := get $owners $name }}
{{- if and (not $owner) (hasPrefix "no" $name) }}
{{- $owner = get $owners (trimPrefix "no" $name) }}
{{- end }}
{{- if $owner }}
{{- fail (printf "server.extraArgs: %s is set by the chart; use %s instead" $flag $owner) }}
{{- end }}
- {{ . | quote }}
{{- end }}
{{- end }}
