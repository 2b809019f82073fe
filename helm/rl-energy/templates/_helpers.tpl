{{/* Chart name, truncated to 63 chars (DNS-1123 label). */}}
{{- define "rl-energy.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name. */}}
{{- define "rl-energy.fullname" -}}
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

{{/* Common labels. */}}
{{- define "rl-energy.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "rl-energy.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels. */}}
{{- define "rl-energy.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rl-energy.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Name of the ServiceAccount. */}}
{{- define "rl-energy.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rl-energy.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Name of the node agent's ServiceAccount. */}}
{{- define "rl-energy.agentServiceAccountName" -}}
{{- printf "%s-agent" (include "rl-energy.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* An image reference from {repository, tag, digest}: repository@digest when a digest is set. */}}
{{- define "rl-energy.image" -}}
{{- if .digest }}
{{- printf "%s@%s" .repository .digest }}
{{- else }}
{{- printf "%s:%s" .repository .tag }}
{{- end }}
{{- end }}

{{/* Names of the pull secrets: global.imagePullSecrets, then imagePullSecrets (names or {name}). */}}
{{- define "rl-energy.pullSecretNames" -}}
{{- $names := list }}
{{- $global := dig "imagePullSecrets" list (.Values.global | default dict) }}
{{- range concat $global (.Values.imagePullSecrets | default list) }}
{{- if kindIs "string" . }}
{{- $names = append $names . }}
{{- else }}
{{- $names = append $names .name }}
{{- end }}
{{- end }}
{{- $names | uniq | toJson }}
{{- end }}
