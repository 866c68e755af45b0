{{/* Names and labels shared by every template. */}}
{{- define "dspark.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dspark.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Selector labels of one component: call with (dict "ctx" $ "component" "verifier"). */}}
{{- define "dspark.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dspark.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "dspark.labels" -}}
{{ include "dspark.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "dspark.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The Redis URL every service gets as $(DSPARK_REDIS_URL). */}}
{{- define "dspark.redisUrl" -}}
{{- if .Values.redis.external.url -}}
{{ .Values.redis.external.url }}
{{- else if .Values.redis.auth.enabled -}}
redis://:$(REDIS_PASSWORD)@{{ include "dspark.fullname" . }}-redis:6379/0
{{- else -}}
redis://{{ include "dspark.fullname" . }}-redis:6379/0
{{- end -}}
{{- end -}}

{{- define "dspark.internalAuthSecretName" -}}
{{- .Values.internalAuth.existingSecret | default (printf "%s-internal-auth" (include "dspark.fullname" .)) -}}
{{- end -}}

{{- define "dspark.redisSecretName" -}}
{{- .Values.redis.auth.existingSecret | default (printf "%s-redis" (include "dspark.fullname" .)) -}}
{{- end -}}

{{/* Env shared by the three services: config, Redis, TLS, tracing, pod identity. */}}
{{- define "dspark.commonEnv" -}}
{{- $ctx := .ctx -}}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: POD_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
# Bind the pod's own address (the services default to loopback).
- name: DSPARK_HOST
  value: "$(POD_IP)"
# Read-only root filesystem: caches (torch, triton, HF) go to the /tmp emptyDir.
- name: HOME
  value: /tmp
{{- if ne .component "gateway" }}
# The internal plane's shared secret (the gateway only calls the public Generation service).
- name: DSPARK_INTERNAL_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "dspark.internalAuthSecretName" $ctx }}
      key: {{ $ctx.Values.internalAuth.secretKey }}
{{- end }}
{{- if and $ctx.Values.redis.auth.enabled (not $ctx.Values.redis.external.url) }}
# Defined before DSPARK_REDIS_URL so Kubernetes expands $(REDIS_PASSWORD) inside it.
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "dspark.redisSecretName" $ctx }}
      key: {{ $ctx.Values.redis.auth.secretKey }}
{{- end }}
- name: DSPARK_REDIS_URL
  value: {{ include "dspark.redisUrl" $ctx | quote }}
{{- if $ctx.Values.tls.enabled }}
- name: DSPARK_TLS_CERT
  value: /etc/dspark/tls/tls.crt
- name: DSPARK_TLS_KEY
  value: /etc/dspark/tls/tls.key
- name: DSPARK_TLS_CA
  value: /etc/dspark/tls/ca.crt
- name: DSPARK_TLS_SERVER_NAME
  value: {{ $ctx.Values.tls.serverName | quote }}
{{- if $ctx.Values.tls.mutual }}
- name: DSPARK_TLS_MUTUAL
  value: "1"
{{- end }}
{{- end }}
{{- if $ctx.Values.otel.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $ctx.Values.otel.endpoint | quote }}
{{- end }}
- name: OTEL_SERVICE_NAME
  value: dspark-{{ .component }}
{{- end -}}

{{/* Pod annotations: Prometheus scraping and a config checksum so config edits roll pods. */}}
{{- define "dspark.podAnnotations" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- if .Values.metrics.annotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .Values.ports.metrics | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}

{{- define "dspark.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsGroup }}
fsGroup: {{ .Values.securityContext.fsGroup }}
seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{- define "dspark.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities: {drop: [ALL]}
{{- end -}}

{{/* gRPC probes on the plaintext health port: call with (dict "ctx" $ "startup" .Values.verifier.startupProbe). */}}
{{- define "dspark.probes" -}}
startupProbe:
  grpc: {port: {{ .ctx.Values.ports.health }}}
  periodSeconds: {{ .startup.periodSeconds }}
  failureThreshold: {{ .startup.failureThreshold }}
readinessProbe:
  grpc: {port: {{ .ctx.Values.ports.health }}}
  periodSeconds: 5
  failureThreshold: 3
livenessProbe:
  grpc: {port: {{ .ctx.Values.ports.health }}}
  periodSeconds: 10
  failureThreshold: 6
{{- end -}}

{{- define "dspark.tlsVolume" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "dspark.tlsMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/dspark/tls
  readOnly: true
{{- end }}
{{- end -}}

{{/*
--device for a GPU component, checked against the GPUs its pod requests, so values and flags
agree: a pod that pays for a GPU runs on it, cuda:N stays within the pod's GPUs, and int8 (a CPU
kernel) is not asked of a GPU.
*/}}
{{- define "dspark.deviceArg" -}}
{{- $device := .ctx.Values.model.device -}}
{{- $gpus := int (index (.resources.limits | default dict) "nvidia.com/gpu" | default 0) -}}
{{- if and (gt $gpus 0) (not (hasPrefix "cuda" $device)) -}}
{{- fail (printf "model.device=%s but the %s requests nvidia.com/gpu=%d: set model.device=cuda" $device .component $gpus) -}}
{{- end -}}
{{- if hasPrefix "cuda:" $device -}}
{{- $index := int (trimPrefix "cuda:" $device) -}}
{{- if ge $index $gpus -}}
{{- fail (printf "model.device=%s but the %s requests only nvidia.com/gpu=%d (devices cuda:0..cuda:%d)" $device .component $gpus (sub $gpus 1)) -}}
{{- end -}}
{{- end -}}
{{- if and (hasPrefix "cuda" $device) (has .ctx.Values.model.precision (list "int8" "gguf" "gguf-q8")) -}}
{{- fail (printf "model.precision=%s runs on CPU kernels only: use auto, bf16 or fp32 with model.device=cuda" .ctx.Values.model.precision) -}}
{{- end -}}
--device=$(DSPARK_DEVICE)
{{- end }}
