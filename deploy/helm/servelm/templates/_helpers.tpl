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

{{/* "true" when the engine pod fetches its own weights in an init container, with no Job: a
     ReadWriteOnce(Pod) claim holds one engine pod, and a fetch Job's pod beside it would be a
     second pod on the claim that nothing puts on the same node (the scheduler does not
     co-locate by claim); on block storage it would wait on Multi-Attach, the engine on it. */}}
{{- define "servelm.fetchInPod" -}}
{{- if ne (include "servelm.accessMode" .) "ReadWriteMany" }}true{{ end }}
{{- end }}

{{/* The `servelm fetch` container of a track's model: the fetch Job's, or the engine pod's
     init container (servelm.fetchInPod). Call with (dict "root" $ "model" $m). */}}
{{- define "servelm.fetchContainer" -}}
{{- $v := .root.Values -}}
name: fetch
image: {{ include "servelm.image" .root }}
imagePullPolicy: {{ $v.image.pullPolicy }}
# resumes an interrupted download; a complete folder asks the hub nothing
command: [servelm, fetch]
args:
  - {{ .model.repo }}
  - --revision={{ .model.revision }}
  - --store={{ .model.store }}
env:
  - name: HF_HUB_OFFLINE  # the image runs offline; the fetch is the one that may not
    value: "0"
  {{- with $v.model.hfEndpoint }}
  - name: HF_ENDPOINT
    value: {{ . | quote }}
  {{- end }}
  {{- if $v.model.hfToken.secretName }}
  - name: HF_TOKEN
    valueFrom:
      secretKeyRef:
        name: {{ $v.model.hfToken.secretName }}
        key: {{ $v.model.hfToken.secretKey }}
  {{- end }}
resources:
  {{- toYaml $v.fetch.resources | nindent 2 }}
securityContext:
  {{- toYaml $v.engine.securityContext | nindent 2 }}
volumeMounts:
  - name: models
    mountPath: /models
  - name: tmp
    mountPath: /tmp
{{- end }}

{{/* The fetch Job's spec. Call with (dict "root" $ "model" $m). */}}
{{- define "servelm.fetchJobSpec" -}}
{{- $v := .root.Values -}}
backoffLimit: {{ $v.fetch.backoffLimit }}
activeDeadlineSeconds: {{ $v.fetch.activeDeadlineSeconds }}
template:
  metadata:
    labels:
      {{- include "servelm.selectorLabels" .root | nindent 6 }}
      app.kubernetes.io/component: fetch
  spec:
    restartPolicy: OnFailure
    {{- with $v.imagePullSecrets }}
    imagePullSecrets:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    securityContext:
      {{- toYaml $v.engine.podSecurityContext | nindent 6 }}
    containers:
      - {{ include "servelm.fetchContainer" . | indent 8 | trim }}
    volumes:
      - name: models
        persistentVolumeClaim:
          claimName: {{ include "servelm.claimName" .root }}
      - name: tmp
        emptyDir: {}
{{- end }}

{{/* Seconds the startup probe gives a track's engine: twice its load-time budget, plus on the
     CPU engine.kernelBuildSeconds, for a pod's first start compiling servelm's C kernels (they
     are CPU-only; a restarted container finds them in the pod's kernel cache volume).
     Call with (dict "root" $ "track" "stable"). */}}
{{- define "servelm.startupSeconds" -}}
{{- $m := include "servelm.trackModel" . | fromYaml }}
{{- $e := .root.Values.engine }}
{{- add (mul 2 $m.budget) (ternary 0 $e.kernelBuildSeconds (gt (int $e.gpus) 0)) }}
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
