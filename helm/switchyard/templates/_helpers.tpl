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
The gateway's config file. Engines are the StatefulSet's pods 0..maxReplicas-1 through the
headless Service (stable DNS names); their sidecars serve /load. Names of pods that do not
exist yet (scaled in, or scaling from zero) do not resolve: those backends stay down, and the
gateway resolves them again every discovery.resolve_interval_ms.
*/}}
{{- define "switchyard.gatewayConfig" -}}
{{- $engine := include "switchyard.engine" . -}}
{{- $cfg := deepCopy .Values.gateway.config -}}
{{- $backends := list -}}
{{- $n := int .Values.engine.maxReplicas -}}
{{- if .Values.keda.enabled -}}{{- $n = max $n (int .Values.keda.maxReplicaCount) | int -}}{{- end -}}
{{- range $i := until $n -}}
{{- $backends = append $backends (dict "url" (printf "http://%s-%d.%s.%s.svc:%d" $engine $i $engine $.Release.Namespace (int $.Values.engine.shim.port))) -}}
{{- end -}}
{{- $_ := set $cfg "listen" (printf "0.0.0.0:%d" (int .Values.gateway.port)) -}}
{{- $_ := set $cfg "admin_listen" (printf "0.0.0.0:%d" (int .Values.gateway.adminPort)) -}}
{{- $_ := set $cfg "discovery" (dict "static" $backends "resolve_interval_ms" 2000) -}}
{{- toYaml $cfg -}}
{{- end -}}
