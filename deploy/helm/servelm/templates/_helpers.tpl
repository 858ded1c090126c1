{{/* Names are cut at 63 characters, the DNS label limit. */}}
{{- define "servelm.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "servelm.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "servelm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "servelm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "servelm.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "servelm.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "servelm.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The engine tracks to render: stable always, canary when enabled. */}}
{{- define "servelm.tracks" -}}
{{- if .Values.canary.enabled }}["stable","canary"]{{ else }}["stable"]{{ end }}
{{- end }}

{{/* Deployment and Service name of an engine track. Call with (dict "root" $ "track" "stable"). */}}
{{- define "servelm.engineName" -}}
{{- $base := printf "%s-engine" (include "servelm.fullname" .root) | trunc 56 | trimSuffix "-" }}
{{- if eq .track "canary" }}{{ printf "%s-canary" $base }}{{ else }}{{ $base }}{{ end }}
{{- end }}

{{/* A track's model as YAML (repo, revision, budget, dir); read it back with fromYaml. */}}
{{- define "servelm.trackModel" -}}
{{- $v := .root.Values }}
{{- $repo := $v.model.repo }}
{{- $rev := $v.model.revision }}
{{- $budget := $v.model.loadTimeBudgetSeconds }}
{{- if eq .track "canary" }}
{{- $repo = default $v.model.repo $v.canary.model.repo }}
{{- $rev = required "canary.model.revision is required when canary.enabled" $v.canary.model.revision }}
{{- if gt (int $v.canary.model.loadTimeBudgetSeconds) 0 }}{{ $budget = $v.canary.model.loadTimeBudgetSeconds }}{{ end }}
{{- end }}
repo: {{ $repo | quote }}
revision: {{ $rev | quote }}
budget: {{ int $budget }}
{{- /* servelm fetch writes <store>/<org>--<name>; a store per revision keeps two versions
       (stable and canary, or before and after an upgrade) apart on one volume. */}}
store: {{ printf "/models/%s" $rev | quote }}
dir: {{ printf "/models/%s/%s" $rev ($repo | replace "/" "--") | quote }}
{{- end }}

{{- define "servelm.servedModelName" -}}
{{- default (base .Values.model.repo) .Values.model.servedModelName }}
{{- end }}

{{/* "true" when more than one engine pod can run at once. */}}
{{- define "servelm.multiPod" -}}
{{- $v := .Values }}
{{- if or $v.canary.enabled (gt (int $v.engine.replicas) 1) (and $v.autoscaling.enabled (gt (int $v.autoscaling.maxReplicas) 1)) }}true{{ else }}false{{ end }}
{{- end }}

{{- define "servelm.accessMode" -}}
{{- $multi := eq (include "servelm.multiPod" .) "true" }}
{{- $mode := .Values.storage.accessMode | default (ternary "ReadWriteMany" "ReadWriteOnce" $multi) }}
{{- if and $multi (ne $mode "ReadWriteMany") }}
{{- fail (printf "storage.accessMode %s: more than one engine pod can run (replicas, autoscaling or canary), so the model volume must be ReadWriteMany" $mode) }}
{{- end }}
{{- $mode }}
{{- end }}

{{- define "servelm.claimName" -}}
{{- .Values.storage.existingClaim | default (printf "%s-models" (include "servelm.fullname" .)) }}
{{- end }}

{{- define "servelm.apiKeySecret" -}}
{{- .Values.apiKey.existingSecret | default (printf "%s-api-key" (include "servelm.fullname" .)) }}
{{- end }}

{{- define "servelm.apiKeyEnabled" -}}
{{- if or .Values.apiKey.existingSecret .Values.apiKey.create }}true{{ end }}
{{- end }}

{{/* The router's address for an engine track: its Service, one upstream per track. */}}
{{- define "servelm.engineURL" -}}
http://{{ include "servelm.engineName" . }}:{{ .root.Values.engine.port }}
{{- end }}

{{- define "servelm.routerName" -}}
{{- printf "%s-router" (include "servelm.fullname" . | trunc 56 | trimSuffix "-") }}
{{- end }}
