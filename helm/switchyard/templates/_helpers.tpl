{{/* Names and labels shared by every template. */}}
{{- define "switchyard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- /*
The base of every object name, at most 45 characters, so that the longest name made from it
stays valid: the engine StatefulSet "<base>-engine" (a StatefulSet's name must leave room for
its pods' 63-character controller-revision-hash label: 52) and "<base>-gateway-admin" (59).
A release name of up to 53 characters (Helm's own limit) renders.
*/ -}}
{{- define "switchyard.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" -}}
{{- else if contains (include "switchyard.name" .) .Release.Name -}}
{{- .Release.Name | trunc 45 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "switchyard.name" .) | trunc 45 | trimSuffix "-" -}}
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
{{- define "switchyard.redis" -}}{{ include "switchyard.fullname" . }}-redis{{- end -}}
{{- /* mode: epp: the InferencePool the gateway (its Deployment and Service, as the EPP) picks for. */ -}}
{{- define "switchyard.inferencePool" -}}{{ include "switchyard.fullname" . }}{{- end -}}

{{- /* The engine pods' labels: their StatefulSet's selector, the engine Service's, the InferencePool's. */ -}}
{{- define "switchyard.engineSelector" -}}
{{ include "switchyard.selector" . }}
app.kubernetes.io/component: engine
{{- end -}}

{{- /*
The port requests go to on an engine pod: the sidecar's (named shim), never the engine's own,
which listens on loopback only. The kubernetes discovery's port_name and the InferencePool's
targetPorts both name it.
*/ -}}
{{- define "switchyard.enginePortName" -}}shim{{- end -}}
{{- define "switchyard.enginePort" -}}{{ .Values.engine.shim.port }}{{- end -}}

{{- define "switchyard.image" -}}
{{- $root := index . 0 -}}{{- $name := index . 1 -}}
{{- $registry := required "image.registry: set the registry holding the switchyard images (nothing is published for you: scripts/build-images.sh REGISTRY builds and pushes them)" $root.Values.image.registry -}}
{{- printf "%s/%s:%s" $registry $name (default $root.Chart.AppVersion $root.Values.image.tag) -}}
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
mode: epp: no API listener; the gateway serves the Endpoint Picker's gRPC (epp.listen) and
finds the engines through the InferencePool (its selector over Pods, at its targetPorts).
*/}}
{{- define "switchyard.gatewayConfig" -}}
{{- $gw := .Values.gateway -}}
{{- $cfg := deepCopy $gw.config -}}
{{- if hasKey (default dict $cfg.timeouts) "request_body_ms" -}}
{{- fail "gateway.config.timeouts.request_body_ms was removed from the gateway: set gateway.config.limits.body_read_timeout_ms instead" -}}
{{- end -}}
{{- $epp := eq .Values.mode "epp" -}}
{{- if $epp -}}
{{- /* The client-facing proxy is the user's Gateway: nothing of the edge's own ways in applies. */ -}}
{{- if $gw.tls.enabled -}}
{{- fail "mode: epp serves no API listener (gateway.tls is TLS on it): clients reach the engines through your Gateway, which terminates TLS; set gateway.tls.enabled=false" -}}
{{- end -}}
{{- if or $gw.ingress.enabled $gw.httpRoute.enabled -}}
{{- fail "mode: epp serves no API listener for gateway.ingress or gateway.httpRoute to send to: route your Gateway to the InferencePool instead (epp.httpRoute)" -}}
{{- end -}}
{{- else if .Values.epp.httpRoute.enabled -}}
{{- fail "epp.httpRoute routes a Gateway to the InferencePool, which only mode: epp renders (mode: edge: gateway.httpRoute)" -}}
{{- end -}}
{{- if $epp -}}
{{- /* No OpenAI listener: the gateway is the Endpoint Picker (ext_proc over gRPC) instead. */ -}}
{{- if eq (int .Values.epp.port) (int $gw.adminPort) -}}
{{- fail "epp.port must differ from gateway.adminPort (the picker's gRPC and the admin port are two listeners)" -}}
{{- end -}}
{{- $_ := set $cfg "listen" nil -}}
{{- $_ := set $cfg "epp" (dict "listen" (printf "0.0.0.0:%d" (int .Values.epp.port)) "destination_header" .Values.epp.destinationHeader "fallbacks" (int .Values.epp.fallbacks)) -}}
{{- else -}}
{{- $_ := set $cfg "listen" (printf "0.0.0.0:%d" (int $gw.port)) -}}
{{- end -}}
{{- $_ := set $cfg "admin_listen" (printf "0.0.0.0:%d" (int $gw.adminPort)) -}}
{{- with $gw.admin.tokenSha256 -}}
{{- if and $.Values.serviceMonitor.enabled (not $.Values.serviceMonitor.bearerTokenSecret) -}}
{{- fail "gateway.admin.tokenSha256 is set: the ServiceMonitor needs serviceMonitor.bearerTokenSecret (a Secret with the token under key token) or Prometheus gets 401" -}}
{{- end -}}
{{- $_ := set $cfg "admin" (dict "token_sha256" .) -}}
{{- end -}}
{{- if .Values.keda.enabled -}}
{{- /* Engines scale from zero: a gateway that left its Service for want of an engine could never receive the request that wakes them. */ -}}
{{- $_ := set $cfg "readiness" (dict "require_backend" false) -}}
{{- end -}}
{{- if $epp -}}
{{- /* The pool's selector and targetPorts over the Pods of this namespace (the Role reads both). */ -}}
{{- $_ := set $cfg "discovery" (dict "inference_pool" (dict "name" (include "switchyard.inferencePool" .) "namespace" .Release.Namespace)) -}}
{{- else -}}
{{- $k8s := dict "namespace" .Release.Namespace "service" (include "switchyard.engine" .) "port_name" (include "switchyard.enginePortName" .) -}}
{{- $_ := set $cfg "discovery" (dict "kubernetes" $k8s) -}}
{{- end -}}
{{- if $gw.tls.enabled -}}
{{- $_ := required "gateway.tls.secretName: the kubernetes.io/tls Secret to serve is needed when gateway.tls.enabled" $gw.tls.secretName -}}
{{- $tls := dict "cert_file" (printf "%s/tls.crt" (include "switchyard.tlsDir" .)) "key_file" (printf "%s/tls.key" (include "switchyard.tlsDir" .)) -}}
{{- if not (kindIs "invalid" $gw.tls.http2) -}}{{- $_ := set $tls "http2" $gw.tls.http2 -}}{{- end -}}
{{- $_ := set $cfg "tls" $tls -}}
{{- end -}}
{{- if $gw.auth.enabled -}}
{{- if not (or $gw.auth.existingSecret $gw.auth.keys) -}}
{{- fail "gateway.auth.enabled needs gateway.auth.existingSecret (a Secret with keys.yaml) or gateway.auth.keys: without keys the gateway lets every request through" -}}
{{- end -}}
{{- $auth := dict -}}
{{- with $gw.auth.keys -}}{{- $_ := set $auth "keys" . -}}{{- end -}}
{{- if $gw.auth.existingSecret -}}{{- $_ := set $auth "keys_file" (printf "%s/keys.yaml" (include "switchyard.keysDir" .)) -}}{{- end -}}
{{- if not (kindIs "invalid" $gw.auth.defaultMaxTokens) -}}{{- $_ := set $auth "default_max_tokens" (int64 $gw.auth.defaultMaxTokens) -}}{{- end -}}
{{- with $gw.auth.sharedLimits -}}{{- if .enabled -}}
{{- $url := .redisUrl -}}
{{- if not $url -}}
{{- if not $.Values.redis.enabled -}}
{{- fail "gateway.auth.sharedLimits.enabled needs gateway.auth.sharedLimits.redisUrl or redis.enabled" -}}
{{- end -}}
{{- $url = printf "redis://%s:6379" (include "switchyard.redis" $) -}}
{{- end -}}
{{- $shared := dict "redis_url" $url "key_prefix" .keyPrefix "timeout_ms" (int64 .timeoutMs) -}}
{{- if not (kindIs "invalid" .failOpen) -}}{{- $_ := set $shared "fail_open" .failOpen -}}{{- end -}}
{{- $_ := set $auth "shared_limits" $shared -}}
{{- end -}}{{- end -}}
{{- $_ := set $cfg "auth" $auth -}}
{{- end -}}
{{- $drain := $gw.drain -}}
{{- if gt (int64 $drain.closeListenersAfterMs) (mul (int64 $drain.gracePeriodSeconds) 1000) -}}
{{- fail "gateway.drain.closeListenersAfterMs must not be past gateway.drain.gracePeriodSeconds" -}}
{{- end -}}
{{- $_ := set $cfg "drain" (dict "grace_period_secs" (int64 $drain.gracePeriodSeconds) "close_listeners_after_ms" (int64 $drain.closeListenersAfterMs)) -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* Where the gateway's Secrets are mounted (directories, so renewed files appear live). */}}
{{- define "switchyard.tlsDir" -}}/etc/switchyard/tls{{- end -}}
{{- define "switchyard.keysDir" -}}/etc/switchyard/keys{{- end -}}

{{/* The gateway pod's grace: the gateway's drain plus 5 s, so the kubelet never kills a draining gateway. */}}
{{- define "switchyard.gatewayTerminationGrace" -}}{{ add (int64 .Values.gateway.drain.gracePeriodSeconds) 5 }}{{- end -}}

{{/* The engine's /health from inside its container (it listens on loopback only). */}}
{{- define "switchyard.engineHealthProbe" -}}
exec 3<>/dev/tcp/127.0.0.1/{{ .Values.engine.port }} && printf 'GET /health HTTP/1.0\r\n\r\n' >&3 && head -n1 <&3 | grep -q ' 200 '
{{- end -}}
