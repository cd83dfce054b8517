{{/*
Combinations values.schema.json cannot express clearly. Each failure names the values to change.
Rendered first by every manifest through "relaygr.validate" (in templates/validate.yaml).
*/}}

{{/* Config fields the chart sets itself, and the values that set them. */}}
{{- define "relaygr.managedFields" -}}
listen: "<service>.port"
etcd_endpoints: "etcd.bundled / etcd.external.endpoints"
etcd_prefix: "etcd.prefix"
etcd_ca: "etcd.external.tls"
etcd_cert: "etcd.external.tls"
etcd_key: "etcd.external.tls"
etcd_user: "etcd.external.auth.user"
etcd_password: "etcd.external.auth.passwordSecret"
metrics_port: "metrics.enabled / metrics.port"
log_level: "logging.level"
log_format: "logging.format"
tls_cert: "tls.enabled / tls.secretName"
tls_key: "tls.enabled / tls.secretName"
tls_ca: "tls.enabled / tls.secretName"
tls_client_ca: "tls.clientCaSecretName"
authz: "tls.authz.enabled"
trust_domain: "tls.authz.trustDomain"
authz_entry_callers: "tls.authz.entryCallers"
plaintext: "tls.enabled"
tls_server_name: "the DNS names the chart dials (the certificate must carry them)"
instance_id: "the pod name (StatefulSet ordinal)"
advertise_address: "ranker.advertise"
device: "ranker.device"
model_config: "ranker.modelConfig"
checkpoint: "ranker.checkpoint"
router_address: "the routers' headless Service of this release (<router>-pods)"
{{- end -}}

{{- define "relaygr.validate" -}}
{{- $v := .Values -}}
{{- $etcd := $v.etcd -}}
{{- if and $etcd.bundled.enabled $etcd.external.enabled -}}
{{- fail "etcd: etcd.bundled.enabled and etcd.external.enabled are both true; choose one (for external endpoints set etcd.bundled.enabled=false)" -}}
{{- end -}}
{{- if not (or $etcd.bundled.enabled $etcd.external.enabled) -}}
{{- fail "etcd: neither etcd.bundled.enabled nor etcd.external.enabled is true; the services need one etcd" -}}
{{- end -}}
{{- if and $etcd.external.enabled (not $etcd.external.endpoints) -}}
{{- fail "etcd: etcd.external.enabled is true but etcd.external.endpoints is empty; list the client endpoints as host:port" -}}
{{- end -}}
{{- if and $etcd.bundled.enabled $etcd.external.endpoints -}}
{{- fail "etcd: etcd.external.endpoints is set but the bundled etcd is enabled; set etcd.bundled.enabled=false and etcd.external.enabled=true to use them" -}}
{{- end -}}
{{- if and $etcd.bundled.enabled $etcd.bundled.podDisruptionBudget.enabled (eq (int $etcd.bundled.replicas) 1) -}}
{{- fail "etcd: a PodDisruptionBudget on a 1-member etcd blocks every node drain; run 3 members or set etcd.bundled.podDisruptionBudget.enabled=false" -}}
{{- end -}}
{{- if and $etcd.external.enabled $etcd.external.tls.enabled (not $etcd.external.tls.secretName) -}}
{{- fail "etcd: etcd.external.tls.enabled needs etcd.external.tls.secretName (a Secret with ca.crt, tls.crt, tls.key)" -}}
{{- end -}}
{{- if and $etcd.external.enabled $etcd.external.auth.user (not $etcd.external.auth.passwordSecret.name) -}}
{{- fail "etcd: etcd.external.auth.user needs etcd.external.auth.passwordSecret.name (the password is never a value)" -}}
{{- end -}}

{{- $ranker := $v.ranker -}}
{{- $resource := $ranker.accelerator.resource -}}
{{- if eq $ranker.device "npu" -}}
{{- if not $resource -}}
{{- fail "ranker: ranker.device=npu needs an accelerator resource: set ranker.accelerator.resource (e.g. huawei.com/Ascend910)" -}}
{{- end -}}
{{- if not (hasPrefix "huawei.com/Ascend" $resource) -}}
{{- fail (printf "ranker: ranker.device=npu but ranker.accelerator.resource=%s is not an Ascend resource (huawei.com/Ascend...)" $resource) -}}
{{- end -}}
{{- else if eq $ranker.device "cuda" -}}
{{- if not $resource -}}
{{- fail "ranker: ranker.device=cuda needs an accelerator resource: set ranker.accelerator.resource (e.g. nvidia.com/gpu)" -}}
{{- end -}}
{{- if not (hasPrefix "nvidia.com/" $resource) -}}
{{- fail (printf "ranker: ranker.device=cuda but ranker.accelerator.resource=%s is not an NVIDIA resource (nvidia.com/...)" $resource) -}}
{{- end -}}
{{- else if $resource -}}
{{- fail (printf "ranker: ranker.device=%s computes on the CPU but ranker.accelerator.resource=%s; set ranker.device to npu or cuda, or clear the resource" $ranker.device $resource) -}}
{{- end -}}
{{- range $limit := list "requests" "limits" -}}
{{- if hasKey (index $ranker.resources $limit | default dict) "memory" -}}
{{- fail (printf "ranker: ranker.resources.%s.memory is derived from config.hbm_budget_mb, config.dram_budget_mb and memoryOverheadMi; remove it and size those instead" $limit) -}}
{{- end -}}
{{- end -}}
{{- if and $ranker.modelConfig $ranker.checkpoint.path -}}
{{- fail "ranker: set either ranker.modelConfig or ranker.checkpoint, not both" -}}
{{- end -}}
{{- if and $ranker.checkpoint.path (not $ranker.checkpoint.volume) -}}
{{- fail "ranker: ranker.checkpoint.path needs ranker.checkpoint.volume (the volume that holds it)" -}}
{{- end -}}
{{- if and $v.tls.enabled (eq $ranker.advertise "podIP") -}}
{{- fail "ranker: ranker.advertise=podIP cannot be verified under TLS (certificates name DNS names); use ranker.advertise=dns" -}}
{{- end -}}

{{- if and $etcd.external.tls.serviceCertificates (not (and $etcd.external.enabled $etcd.external.tls.enabled $v.tls.enabled)) -}}
{{- fail "etcd: etcd.external.tls.serviceCertificates needs etcd.external.enabled, etcd.external.tls.enabled and tls.enabled (the services' own certificates)" -}}
{{- end -}}
{{- if and $etcd.external.roles.create (not (and $etcd.external.enabled $etcd.external.tls.enabled $etcd.external.roles.rootPasswordSecret.name)) -}}
{{- fail "etcd: etcd.external.roles.create needs etcd.external.enabled, etcd.external.tls.enabled and etcd.external.roles.rootPasswordSecret.name (etcd's root password)" -}}
{{- end -}}
{{- if $v.tls.enabled -}}
{{- range $component := list "router" "trigger" "ranker" -}}
{{- if not (include "relaygr.tlsSecret" (dict "root" $ "component" $component)) -}}
{{- fail (printf "tls: tls.enabled needs tls.secrets.%s or tls.secretName (a Secret with tls.crt, tls.key and ca.crt)" $component) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- $managed := include "relaygr.managedFields" . | fromYaml -}}
{{- range $component := list "router" "trigger" "ranker" -}}
{{- $svc := index $v $component -}}
{{- range $key, $_ := $svc.config -}}
{{- if hasKey $managed $key -}}
{{- fail (printf "%s: %s.config.%s is set by the chart from %s; remove it from %s.config" $component $component $key (index $managed $key | replace "<service>" $component) $component) -}}
{{- end -}}
{{- end -}}
{{- $drain := $svc.config.drain_grace_s | float64 -}}
{{- /* SIGTERM: health NOT_SERVING, then config.health_linger_s serving on (service default
       0.5 s; a ranker's 0), then the drain. */ -}}
{{- $linger := dig "health_linger_s" (ternary 0.0 0.5 (eq $component "ranker")) $svc.config | float64 -}}
{{- $needed := addf $drain $svc.preStopSleepSeconds $linger -}}
{{- $terms := "preStopSleepSeconds + config.health_linger_s + config.drain_grace_s" -}}
{{- /* A draining ranker first hands its prefixes off, for min(handoff_budget_s, drain_grace_s)
       (service default 5 s), then stops its server with drain_grace_s. */ -}}
{{- if and (eq $component "ranker") (ne (toString (dig "handoff" true $svc.config)) "false") -}}
{{- $handoff := minf (dig "handoff_budget_s" 5.0 $svc.config | float64) $drain -}}
{{- $needed = addf $needed $handoff -}}
{{- $terms = printf "%s + min(config.handoff_budget_s, config.drain_grace_s)" $terms -}}
{{- end -}}
{{- if le ($svc.terminationGracePeriodSeconds | float64) $needed -}}
{{- fail (printf "%s: %s.terminationGracePeriodSeconds=%v must exceed %s = %v, or the drain is cut short" $component $component $svc.terminationGracePeriodSeconds $terms $needed) -}}
{{- end -}}
{{- with $svc.autoscaling -}}
{{- if and .enabled (gt (int .minReplicas) (int .maxReplicas)) -}}
{{- fail (printf "%s: %s.autoscaling.minReplicas=%v exceeds maxReplicas=%v" $component $component .minReplicas .maxReplicas) -}}
{{- end -}}
{{- end -}}
{{- if $svc.podDisruptionBudget.enabled -}}
{{- $replicas := $svc.replicas -}}
{{- if and (hasKey $svc "autoscaling") $svc.autoscaling.enabled -}}
{{- $replicas = $svc.autoscaling.minReplicas -}}
{{- end -}}
{{- if le (int $replicas) 1 -}}
{{- fail (printf "%s: a PodDisruptionBudget with %v replica(s) blocks every node drain; run 2 or more replicas or set %s.podDisruptionBudget.enabled=false" $component $replicas $component) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
