{{/* Names and labels shared by every template. */}}
{{- define "switchyard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "switchyard.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "switchyard.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "switchyard.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "switchyard.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/name: {{ include "switchyard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "switchyard.selector" -}}
app.kubernetes.io/name: {{ include "switchyard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "switchyard.gateway" -}}{{ include "switchyard.fullname" . }}-gateway{{- end -}}
{{- define "switchyard.engine" -}}{{ include "switchyard.fullname" . }}-engine{{- end -}}

{{- define "switchyard.image" -}}
{{- $root := index . 0 -}}{{- $name := index . 1 -}}
{{- printf "%s/%s:%s" $root.Values.image.registry $name (default $root.Chart.AppVersion $root.Values.image.tag) -}}
{{- end -}}

{{- define "switchyard.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "switchyard.gateway" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
The gateway's config file. Engines are found through the EndpointSlices of the engines'
Service (the gateway's Role allows get/list/watch): ready pods take requests, terminating
ones finish what they serve and get nothing new; the sidecars' /load carries their load.
*/}}
{{- define "switchyard.gatewayConfig" -}}
{{- $cfg := deepCopy .Values.gateway.config -}}
{{- $_ := set $cfg "listen" (printf "0.0.0.0:%d" (int .Values.gateway.port)) -}}
{{- $_ := set $cfg "admin_listen" (printf "0.0.0.0:%d" (int .Values.gateway.adminPort)) -}}
{{- $k8s := dict "namespace" .Release.Namespace "service" (include "switchyard.engine" .) "port_name" "shim" -}}
{{- $_ := set $cfg "discovery" (dict "kubernetes" $k8s) -}}
{{- toYaml $cfg -}}
{{- end -}}
