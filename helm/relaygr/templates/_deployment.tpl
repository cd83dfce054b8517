{{/*
A stateless service (router, trigger): Deployment, its ClusterIP Service, and a headless Service
(relaygr.podsName) naming every ready pod, for callers that balance over the replicas themselves.
Input: dict root, component.
*/}}
{{- define "relaygr.deployment" -}}
{{- $root := .root -}}
{{- $component := .component -}}
{{- $ctx := dict "root" $root "component" $component -}}
{{- $name := include "relaygr.componentName" $ctx -}}
{{- $svc := index $root.Values $component -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  labels:
    {{- include "relaygr.labels" $ctx | nindent 4 }}
spec:
  {{- if not $svc.autoscaling.enabled }}
  replicas: {{ $svc.replicas }}
  {{- end }}
  revisionHistoryLimit: 5
  strategy:
    type: RollingUpdate
    rollingUpdate:
      maxUnavailable: 0
      maxSurge: 1
  selector:
    matchLabels:
      {{- include "relaygr.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "relaygr.selectorLabels" $ctx | nindent 8 }}
        {{- with $svc.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with include "relaygr.podAnnotations" $ctx | trim }}
      annotations:
        {{- . | nindent 8 }}
      {{- end }}
    spec:
      {{- include "relaygr.podCommon" $ctx | nindent 6 }}
      containers:
        - name: {{ $component }}
          {{- include "relaygr.containerCommon" $ctx | nindent 10 }}
          args:
            - {{ $component }}
            {{- include "relaygr.commonArgs" $ctx | trim | nindent 12 }}
            {{- if eq $component "trigger" }}
            {{- $router := include "relaygr.componentName" (dict "root" $root "component" "router") }}
            {{- $routers := include "relaygr.podsName" (dict "root" $root "component" "router") }}
            - {{ printf "--router-address=dns:///%s:%d" (include "relaygr.serviceFQDN" (dict "root" $root "name" $routers)) (int $root.Values.router.port) | quote }}
            {{- end }}
            {{- include "relaygr.configArgs" $svc.config | trim | nindent 12 }}
          env:
            {{- include "relaygr.commonEnv" $ctx | trim | nindent 12 }}
          {{- include "relaygr.probes" (merge (dict "serverName" (include "relaygr.serviceFQDN" (dict "root" $root "name" $name))) $ctx) | nindent 10 }}
          resources:
            {{- toYaml $svc.resources | nindent 12 }}
          volumeMounts:
            {{- include "relaygr.commonVolumeMounts" $root | nindent 12 }}
      volumes:
        {{- include "relaygr.commonVolumes" $ctx | nindent 8 }}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}
  labels:
    {{- include "relaygr.labels" $ctx | nindent 4 }}
  {{- with $svc.service.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  type: {{ $svc.service.type }}
  selector:
    {{- include "relaygr.selectorLabels" $ctx | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $svc.port }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
    {{- if $root.Values.metrics.enabled }}
    - name: metrics
      port: {{ $root.Values.metrics.port }}
      targetPort: metrics
      protocol: TCP
    {{- end }}
---
# Headless: its DNS name resolves to every ready pod (not to one virtual IP), so a gRPC channel
# to dns:///<this name>:<port> with relaygr.balancing.replica_options spreads its calls over the
# replicas and leaves a draining one (the trigger's channel to the routers is one).
apiVersion: v1
kind: Service
metadata:
  name: {{ include "relaygr.podsName" $ctx }}
  labels:
    {{- include "relaygr.labels" $ctx | nindent 4 }}
spec:
  clusterIP: None
  selector:
    {{- include "relaygr.selectorLabels" $ctx | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $svc.port }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
{{- end -}}
