{{- define "grstack.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 53 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 53 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "grstack.labels" -}}
app.kubernetes.io/name: grstack
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "grstack.image" -}}
{{- printf "%s:%s" .Values.image.repository (default (printf "%s-cpu" .Chart.AppVersion) .Values.image.tag) -}}
{{- end -}}

{{- define "grstack.operatorImage" -}}
{{- if .Values.image.operatorTag -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.operatorTag -}}
{{- else -}}
{{- include "grstack.image" . -}}
{{- end -}}
{{- end -}}

{{- define "grstack.peeringName" -}}
{{- default (include "grstack.fullname" .) .Values.operator.leaderElection.peeringName -}}
{{- end -}}

{{- define "grstack.serviceAccountName" -}}
{{- default (include "grstack.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "grstack.etcdEndpoint" -}}
{{- printf "%s://%s-etcd-client:2379" (ternary "https" "http" (not (empty .Values.etcd.serverTLS.secretName))) (include "grstack.fullname" .) -}}
{{- end -}}

{{/* The operator's permissions in a namespace (used by the ClusterRole or by per-namespace Roles). */}}
{{- define "grstack.operatorRules" -}}
- apiGroups: ["grstack.io"]
  resources: ["grtrainingjobs", "grrankingservices"]
  verbs: ["get", "list", "watch", "patch", "delete"]
- apiGroups: ["grstack.io"]
  resources: ["grtrainingjobs/status", "grrankingservices/status"]
  verbs: ["get", "patch"]
- apiGroups: ["grstack.io"]
  resources: ["grtrainingjobs/finalizers", "grrankingservices/finalizers"]
  verbs: ["update"]
# Worker pods; "patch" also lets the operator grant rank 0 "patch" on its own pod (RBAC escalation rule).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps", "serviceaccounts"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["statefulsets", "deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "create", "patch", "delete"]
# Gang scheduling (spec.runPolicy.schedulingPolicy): the job's PodGroup for the coscheduler or Volcano.
- apiGroups: ["scheduling.x-k8s.io", "scheduling.volcano.sh"]
  resources: ["podgroups"]
  verbs: ["get", "list", "create", "patch", "delete"]
# Kueue (a job naming a LocalQueue): the operator owns the job's Workload, marks it Finished and, after an
# eviction, clears its admission (Kueue's contract for a job kind it has no integration for).
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status"]
  verbs: ["get", "patch"]
# Leader election (kopf peering): the replicas keep their heartbeats in the peering object's status.
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}
