{{/* Names, labels and the wiring every service shares. */}}

{{- define "relaygr.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "relaygr.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "relaygr.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "relaygr.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* "<fullname>-<component>"; component names are short, so 50 characters stay for the rest. */}}
{{- define "relaygr.componentName" -}}
{{- printf "%s-%s" (include "relaygr.fullname" .root | trunc 50 | trimSuffix "-") .component -}}
{{- end -}}

{{/* The headless Service of a stateless component's pods (router, trigger). */}}
{{- define "relaygr.podsName" -}}
{{- printf "%s-pods" (include "relaygr.componentName" .) -}}
{{- end -}}

{{- define "relaygr.selectorLabels" -}}
app.kubernetes.io/name: {{ include "relaygr.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "relaygr.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{ include "relaygr.selectorLabels" . }}
app.kubernetes.io/part-of: relaygr
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end -}}

{{- define "relaygr.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "relaygr.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "relaygr.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Cluster DNS name of a Service in the release namespace. */}}
{{- define "relaygr.serviceFQDN" -}}
{{- printf "%s.%s.svc.%s" .name .root.Release.Namespace .root.Values.clusterDomain -}}
{{- end -}}

{{- define "relaygr.etcd.name" -}}
{{- include "relaygr.componentName" (dict "root" . "component" "etcd") -}}
{{- end -}}

{{/* The etcd client endpoints every service dials: each bundled member, or the external list. */}}
{{- define "relaygr.etcd.endpoints" -}}
{{- if .Values.etcd.bundled.enabled -}}
{{- $name := include "relaygr.etcd.name" . -}}
{{- $peers := include "relaygr.serviceFQDN" (dict "root" . "name" $name) -}}
{{- $endpoints := list -}}
{{- range $i := until (int .Values.etcd.bundled.replicas) -}}
{{- $endpoints = append $endpoints (printf "%s-%d.%s:2379" $name $i $peers) -}}
{{- end -}}
{{- join "," $endpoints -}}
{{- else -}}
{{- join "," .Values.etcd.external.endpoints -}}
{{- end -}}
{{- end -}}

{{/*
One flag per entry of a service's `config` map, in key order: `foo_bar: v` -> `--foo-bar=v`,
booleans -> `--foo-bar` / `--no-foo-bar`, lists -> comma-joined. Whole numbers print without an
exponent (YAML numbers arrive as float64, and 1e+06 is no Python int).
*/}}
{{- define "relaygr.configArgs" -}}
{{- range $key, $value := . }}
{{- $flag := replace "_" "-" $key }}
{{- if kindIs "bool" $value }}
- {{ ternary (printf "--%s" $flag) (printf "--no-%s" $flag) $value | quote }}
{{- else if kindIs "slice" $value }}
- {{ printf "--%s=%s" $flag (join "," $value) | quote }}
{{- else if and (kindIs "float64" $value) (eq $value (floor $value)) }}
- {{ printf "--%s=%d" $flag (int64 $value) | quote }}
{{- else }}
- {{ printf "--%s=%v" $flag $value | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
Whole CPUs in a Kubernetes CPU quantity ("2", 2, "1500m", "0.5"), rounded down, at least 1:
the compute threads that fit the share a pod is guaranteed.
*/}}
{{- define "relaygr.wholeCpus" -}}
{{- $quantity := toString . -}}
{{- $cpus := 0.0 -}}
{{- if hasSuffix "m" $quantity -}}
{{- $cpus = divf (float64 (trimSuffix "m" $quantity)) 1000 -}}
{{- else -}}
{{- $cpus = float64 $quantity -}}
{{- end -}}
{{- max 1 (int64 (floor $cpus)) -}}
{{- end -}}

{{/* Mount points inside the containers. */}}
{{- define "relaygr.tlsDir" -}}/etc/relaygr/tls{{- end -}}
{{- define "relaygr.etcdTlsDir" -}}/etc/relaygr/etcd-tls{{- end -}}
{{- define "relaygr.clientCaDir" -}}/etc/relaygr/client-ca{{- end -}}

{{/* The TLS Secret of one component: tls.secrets.<component>, else the shared tls.secretName.
Input: dict root, component. */}}
{{- define "relaygr.tlsSecret" -}}
{{- $tls := .root.Values.tls -}}
{{- (get ($tls.secrets | default dict) .component) | default $tls.secretName -}}
{{- end -}}
{{- define "relaygr.probeDir" -}}/etc/relaygr/probe{{- end -}}
{{- define "relaygr.modelDir" -}}/etc/relaygr/model{{- end -}}
{{- define "relaygr.checkpointDir" -}}/var/lib/relaygr/checkpoint{{- end -}}

{{/*
The flags every service gets from the chart: listen address, etcd, metrics, logging, TLS.
Input: dict root, component ("router", "trigger", "ranker").
*/}}
{{- define "relaygr.commonArgs" -}}
{{- $root := .root -}}
{{- $svc := index $root.Values .component -}}
{{- $etcd := $root.Values.etcd -}}
- {{ printf "--listen=0.0.0.0:%d" (int $svc.port) | quote }}
- {{ printf "--etcd-endpoints=%s" (include "relaygr.etcd.endpoints" $root) | quote }}
- {{ printf "--etcd-prefix=%s" $etcd.prefix | quote }}
{{- if and $etcd.external.enabled $etcd.external.tls.enabled }}
- {{ printf "--etcd-ca=%s/ca.crt" (include "relaygr.etcdTlsDir" .) | quote }}
{{- if $etcd.external.tls.serviceCertificates }}
- {{ printf "--etcd-cert=%s/tls.crt" (include "relaygr.tlsDir" .) | quote }}
- {{ printf "--etcd-key=%s/tls.key" (include "relaygr.tlsDir" .) | quote }}
{{- else if $etcd.external.tls.clientCertificate }}
- {{ printf "--etcd-cert=%s/tls.crt" (include "relaygr.etcdTlsDir" .) | quote }}
- {{ printf "--etcd-key=%s/tls.key" (include "relaygr.etcdTlsDir" .) | quote }}
{{- end }}
{{- end }}
{{- if and $etcd.external.enabled $etcd.external.auth.user }}
- {{ printf "--etcd-user=%s" $etcd.external.auth.user | quote }}
{{- end }}
- {{ printf "--metrics-port=%d" (ternary (int $root.Values.metrics.port) 0 $root.Values.metrics.enabled) | quote }}
- {{ printf "--log-level=%s" $root.Values.logging.level | quote }}
- {{ printf "--log-format=%s" $root.Values.logging.format | quote }}
{{- if $root.Values.tls.enabled }}
{{- $tls := $root.Values.tls }}
- {{ printf "--tls-cert=%s/tls.crt" (include "relaygr.tlsDir" .) | quote }}
- {{ printf "--tls-key=%s/tls.key" (include "relaygr.tlsDir" .) | quote }}
- {{ printf "--tls-ca=%s/ca.crt" (include "relaygr.tlsDir" .) | quote }}
{{- if $tls.clientCaSecretName }}
- {{ printf "--tls-client-ca=%s/ca.crt" (include "relaygr.clientCaDir" .) | quote }}
{{- end }}
- {{ ternary "--authz" "--no-authz" $tls.authz.enabled | quote }}
- {{ printf "--trust-domain=%s" $tls.authz.trustDomain | quote }}
- {{ printf "--authz-entry-callers=%s" (join "," $tls.authz.entryCallers) | quote }}
{{- else }}
- "--plaintext"
{{- end }}
{{- end -}}

{{/*
Environment every service gets: pod identity (for $(POD_NAME) in args), OpenTelemetry, the etcd
password from its Secret. Input: dict root, component.
*/}}
{{- define "relaygr.commonEnv" -}}
{{- $root := .root -}}
{{- $svc := index $root.Values .component -}}
{{- $tracing := $root.Values.tracing -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: HOME
  value: /tmp
- name: OTEL_SERVICE_NAME
  value: {{ printf "relaygr-%s" .component | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "service.namespace=%s,service.instance.id=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE),k8s.pod.name=$(POD_NAME)" $root.Release.Name | quote }}
{{- if $tracing.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $tracing.otlpEndpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: grpc
- name: OTEL_TRACES_SAMPLER
  value: {{ $tracing.sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $tracing.samplerArg | quote }}
{{- else }}
- name: OTEL_SDK_DISABLED
  value: "true"
{{- end }}
{{- $auth := $root.Values.etcd.external.auth }}
{{- if and $root.Values.etcd.external.enabled $auth.user }}
- name: {{ printf "RELAYGR_%s_ETCD_PASSWORD" (upper .component) }}
  valueFrom:
    secretKeyRef:
      name: {{ $auth.passwordSecret.name | quote }}
      key: {{ $auth.passwordSecret.key | quote }}
{{- end }}
{{- with $svc.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
Probes on the gRPC port against grpc.health.v1 (service ""). Kubernetes' grpc probe speaks
plaintext only, so under TLS the same check runs as an exec probe over mTLS (files/
grpc_health_probe.py, mounted from a ConfigMap). Input: dict root, component, serverName.
*/}}
{{- define "relaygr.probeHandler" -}}
{{- $root := .root -}}
{{- $svc := index $root.Values .component -}}
{{- if $root.Values.tls.enabled }}
exec:
  command:
    - python
    - {{ printf "%s/grpc_health_probe.py" (include "relaygr.probeDir" .) }}
    - {{ printf "--port=%d" (int $svc.port) | quote }}
    - {{ printf "--tls-dir=%s" (include "relaygr.tlsDir" .) | quote }}
    - {{ printf "--server-name=%s" .serverName | quote }}
    {{- /* The script's own deadline leaves a second for starting Python. */}}
    - {{ printf "--timeout-s=%d" (max 1 (sub (int $svc.probes.timeoutSeconds) 1)) | quote }}
{{- else }}
grpc:
  port: {{ $svc.port }}
  service: ""
{{- end }}
{{- end -}}

{{- define "relaygr.probes" -}}
{{- $svc := index .root.Values .component -}}
{{- $handler := include "relaygr.probeHandler" . | trim -}}
startupProbe:
  {{- $handler | nindent 2 }}
  periodSeconds: {{ $svc.probes.periodSeconds }}
  timeoutSeconds: {{ $svc.probes.timeoutSeconds }}
  failureThreshold: {{ $svc.probes.startupFailureThreshold }}
readinessProbe:
  {{- $handler | nindent 2 }}
  periodSeconds: {{ $svc.probes.periodSeconds }}
  timeoutSeconds: {{ $svc.probes.timeoutSeconds }}
  failureThreshold: {{ $svc.probes.failureThreshold }}
livenessProbe:
  {{- $handler | nindent 2 }}
  periodSeconds: {{ $svc.probes.periodSeconds }}
  timeoutSeconds: {{ $svc.probes.timeoutSeconds }}
  {{- /* A draining server answers NOT_SERVING: liveness must not kill it before the drain ends. */}}
  failureThreshold: {{ max $svc.probes.failureThreshold (add 1 (div (add (int $svc.terminationGracePeriodSeconds) (int $svc.probes.periodSeconds)) (int $svc.probes.periodSeconds))) }}
{{- end -}}

{{/* Ports, lifecycle and security of a service container. Input: dict root, component. */}}
{{- define "relaygr.containerCommon" -}}
{{- $root := .root -}}
{{- $svc := index $root.Values .component -}}
image: {{ include "relaygr.image" $root | quote }}
imagePullPolicy: {{ $root.Values.image.pullPolicy }}
ports:
  - name: grpc
    containerPort: {{ $svc.port }}
    protocol: TCP
{{- if $root.Values.metrics.enabled }}
  - name: metrics
    containerPort: {{ $root.Values.metrics.port }}
    protocol: TCP
{{- end }}
{{- if gt (int $svc.preStopSleepSeconds) 0 }}
lifecycle:
  preStop:
    exec:
      # Endpoints stop sending before the server starts draining.
      command: ["sleep", "{{ $svc.preStopSleepSeconds }}"]
{{- end }}
securityContext:
  {{- toYaml $root.Values.securityContext | nindent 2 }}
{{- end -}}

{{/* Volumes and mounts every service has: /tmp, the TLS and etcd secrets, the probe script.
Mounts take the root context; volumes take dict root, component (each its own TLS Secret). */}}
{{- define "relaygr.commonVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ include "relaygr.tlsDir" . }}
  readOnly: true
{{- if .Values.tls.clientCaSecretName }}
- name: client-ca
  mountPath: {{ include "relaygr.clientCaDir" . }}
  readOnly: true
{{- end }}
- name: probe
  mountPath: {{ include "relaygr.probeDir" . }}
  readOnly: true
{{- end }}
{{- if and .Values.etcd.external.enabled .Values.etcd.external.tls.enabled }}
- name: etcd-tls
  mountPath: {{ include "relaygr.etcdTlsDir" . }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "relaygr.commonVolumes" -}}
{{- $root := .root -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ $root.Values.tmpSizeLimit }}
{{- if $root.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "relaygr.tlsSecret" . }}
    defaultMode: 0440
{{- if $root.Values.tls.clientCaSecretName }}
- name: client-ca
  secret:
    secretName: {{ $root.Values.tls.clientCaSecretName }}
    defaultMode: 0440
{{- end }}
- name: probe
  configMap:
    name: {{ include "relaygr.componentName" (dict "root" $root "component" "probe") }}
{{- end }}
{{- if and $root.Values.etcd.external.enabled $root.Values.etcd.external.tls.enabled }}
- name: etcd-tls
  secret:
    secretName: {{ $root.Values.etcd.external.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{/* Pod-level settings shared by the service pods. Input: dict root, component. */}}
{{- define "relaygr.podCommon" -}}
{{- $root := .root -}}
{{- $svc := index $root.Values .component -}}
serviceAccountName: {{ include "relaygr.serviceAccountName" $root }}
automountServiceAccountToken: {{ $root.Values.automountServiceAccountToken }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
terminationGracePeriodSeconds: {{ $svc.terminationGracePeriodSeconds }}
{{- with $svc.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $svc.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $svc.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $svc.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $svc.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Pod annotations: Prometheus scraping and the values' podAnnotations. */}}
{{- define "relaygr.podAnnotations" -}}
{{- $root := .root -}}
{{- $svc := index $root.Values .component -}}
{{- if $root.Values.metrics.enabled }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ $root.Values.metrics.port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- with $svc.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end -}}
