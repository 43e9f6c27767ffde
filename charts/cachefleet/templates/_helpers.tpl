{{/* Chart name, truncated to 63 characters. */}}
{{- define "cachefleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: <release>-<chart> unless the release name already contains the chart name. */}}
{{- define "cachefleet.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* chart label value: name-version */}}
{{- define "cachefleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of the operator's pods that selectors match on. */}}
{{- define "cachefleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cachefleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels of every object of the chart. */}}
{{- define "cachefleet.labels" -}}
helm.sh/chart: {{ include "cachefleet.chart" . }}
{{ include "cachefleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Name of the operator's ServiceAccount. */}}
{{- define "cachefleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "cachefleet.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Operator and sidecar image. */}}
{{- define "cachefleet.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Webhook Service name, its TLS Secret and the managed MutatingWebhookConfiguration name. */}}
{{- define "cachefleet.webhookService" -}}
{{- printf "%s-webhook" (include "cachefleet.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- define "cachefleet.webhookSecret" -}}
{{- printf "%s-webhook-tls" (include "cachefleet.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- define "cachefleet.webhookConfig" -}}
{{- printf "%s.cachefleet.io" (include "cachefleet.fullname" .) -}}
{{- end -}}

{{/* True when a Prometheus Operator object of the given key should render. */}}
{{- define "cachefleet.monitoring" -}}
{{- $root := index . 0 -}}{{- $key := index . 1 -}}
{{- if and $root.Values.monitoring.prometheusOperator (index $root.Values.monitoring $key).enabled -}}true{{- end -}}
{{- end -}}

{{/* PromQL: per-tenant hit ratio; the same expression as protocol.promql_hit_ratio, by cache. */}}
{{- define "cachefleet.promqlHitRatio" -}}
{{- $w := . -}}
(sum by (cache, tenant) (rate(cachefleet_requests_total{result="hit"}[{{ $w }}])) or (sum by (cache, tenant) (rate(cachefleet_requests_total{result=~"hit|miss"}[{{ $w }}])) * 0)) / sum by (cache, tenant) (rate(cachefleet_requests_total{result=~"hit|miss"}[{{ $w }}]))
{{- end -}}

{{/* PromQL: per-tenant p95 latency; the same expression as protocol.promql_p95_seconds, by cache. */}}
{{- define "cachefleet.promqlP95" -}}
histogram_quantile(0.95, sum by (cache, tenant, le) (rate(cachefleet_request_duration_seconds_bucket[{{ . }}])))
{{- end -}}

{{/* Rights the operator needs where it watches: its CRs and their status, Events,
namespaced kopf peering, Secrets named by spec.redis.secretRef (read only), Pods (list). */}}
{{- define "cachefleet.namespacedRules" -}}
- apiGroups: [cachefleet.io]
  resources: [inferencecaches, cacheinvalidations]
  verbs: [get, list, watch, patch, update]
- apiGroups: [cachefleet.io]
  resources: [inferencecaches/status, cacheinvalidations/status]
  verbs: [get, patch, update]
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [get, list, watch, patch]
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
{{- end -}}

{{/* The endpoint picker's namespace: that of router.cache (<namespace>/<name>); fails when unset. */}}
{{- define "cachefleet.routerNamespace" -}}
{{- if not .Values.router.cache -}}
{{- fail "router.cache (<namespace>/<name> of the InferenceCache) is required when router.enabled is true" -}}
{{- end -}}
{{- index (splitList "/" .Values.router.cache) 0 -}}
{{- end -}}

{{/* Name of the picker's Deployment, Service, ServiceAccount and Role. */}}
{{- define "cachefleet.routerName" -}}
{{- printf "%s-router" (include "cachefleet.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The InferencePool the picker serves: router.existingPool, else the one rendered, named after the cache. */}}
{{- define "cachefleet.routerPool" -}}
{{- .Values.router.existingPool | default (index (splitList "/" .Values.router.cache) 1) -}}
{{- end -}}

{{/* Labels of the picker's pods that its Service, NetworkPolicy and ServiceMonitor match on. */}}
{{- define "cachefleet.routerSelectorLabels" -}}
{{ include "cachefleet.selectorLabels" . }}
app.kubernetes.io/component: router
{{- end -}}

{{/* Port of the pool's pods the gateway sends to: router.pool.targetPort, else the sidecar's proxy port. */}}
{{- define "cachefleet.routerTargetPort" -}}
{{- .Values.router.pool.targetPort | default .Values.sidecar.proxyPort -}}
{{- end -}}

{{/* True when the PodMonitor of the model servers' own /metrics renders. */}}
{{- define "cachefleet.modelServerMonitor" -}}
{{- include "cachefleet.monitoring" (list . "modelServers") -}}
{{- end -}}

{{/* PromQL: one series per model-server pod of a cache, from the first of the given metric
names it exports, aggregated per pod with the given operator and labelled like the operator's
series (cache_namespace, cache_name). Arguments: (list "sum"|"max" name...). */}}
{{- define "cachefleet.promqlPerPod" -}}
{{- $op := first . -}}
{{- $sel := list -}}
{{- range rest . -}}{{- $sel = append $sel (printf "%s{cachefleet_io_cache!=\"\"}" .) -}}{{- end -}}
label_replace(label_replace({{ $op }} by (namespace, pod, cachefleet_io_cache) ({{ join " or " $sel }}), "cache_namespace", "$1", "namespace", "(.*)"), "cache_name", "$1", "cachefleet_io_cache", "(.*)")
{{- end -}}
