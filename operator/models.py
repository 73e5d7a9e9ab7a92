"""The two custom resources as pydantic models: the single source for the CRD schemas and for validation.

``grstack crds`` turns these into structural OpenAPI v3 schemas (see ``crds.py``); the operator validates
every spec with the same models, so anything the API server cannot check (cross-field rules, the trainer
config itself) is reported as an ``InvalidSpec`` condition with the model's message. Field names are
snake_case in Python and camelCase on the wire, as Kubernetes users expect.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema, model_validator
from pydantic.alias_generators import to_camel

from grstack.operator import names, policy, quantity

# apimachinery's resource.Quantity grammar, as the CRD pattern (integers need none).
QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")


def _quantity(value: int | str) -> int | str:
    quantity.parse(value)  # ValueError names the bad value
    return value


# An int-or-string Kubernetes quantity ("500m", "4Gi", 2); compared by value with what the API server stores.
Quantity = Annotated[
    int | str,
    AfterValidator(_quantity),
    WithJsonSchema({"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True,
                    "pattern": QUANTITY_PATTERN}),
]
# An int-or-string count or percentage (a PodDisruptionBudget's maxUnavailable: 1, "25%").
IntOrPercent = Annotated[
    Annotated[int, Field(ge=0)] | Annotated[str, Field(pattern=r"^[0-9]+%$")],
    WithJsonSchema({"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True,
                    "pattern": r"^[0-9]+%$"}),
]
Replicas = Annotated[int, Field(ge=1, le=names.MAX_REPLICAS)]
# A Kubernetes structure passed through to pods unchanged (tolerations, affinity); the API server checks it
# when the pod is created.
KubeObject = Annotated[dict[str, Any], WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True})]
# One ``--set key=value`` value: any YAML scalar.
Scalar = Annotated[str | int | float | bool, WithJsonSchema({"x-kubernetes-preserve-unknown-fields": True})]

Accelerator = Literal["cpu", "nvidia", "ascend"]
PullPolicy = Literal["Always", "IfNotPresent", "Never"]
ConditionStatus = Literal["True", "False", "Unknown"]
TrainingState = Literal["Created", "Running", "Restarting", "Succeeded", "Failed", "Suspended"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True)


class EnvVar(_Model):
    name: str = Field(min_length=1)
    value: str = ""


class Resources(_Model):
    """Container requests/limits; the accelerator device is added by the operator from ``accelerator``."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    limits: dict[str, Quantity] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _request_within_limit(self) -> Resources:
        for key, limit in self.limits.items():  # the API server refuses such a container
            request = self.requests.get(key)
            if request is not None and quantity.parse(request) > quantity.parse(limit):
                raise ValueError(f"requests.{key} {request} is above limits.{key} {limit}")
        return self


class Scheduling(_Model):
    scheduler_name: str | None = Field(None, description="e.g. volcano for gang scheduling")
    priority_class_name: str | None = None
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[KubeObject] = Field(default_factory=list)
    affinity: KubeObject | None = None


# ---------------------------------------------------------------------------------------------- training


# Environment the operator sets on every worker (the torchrun contract and the progress reporting): a user
# value for one of these is refused, as it would silently break the gang.
RESERVED_WORKER_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                       "NODE_RANK", "GROUP_RANK", "GRSTACK_POD_NAME", "GRSTACK_POD_NAMESPACE",
                       "GRSTACK_PROGRESS_ANNOTATION", "GRSTACK_PROGRESS_INTERVAL")
# Pod fields and volume names the operator owns.
RESERVED_POD_FIELDS = ("restartPolicy", "hostname", "subdomain")
RESERVED_TRAINER_FIELDS = ("image", "command", "args")
RESERVED_VOLUMES = ("tmp", "shm", "config", "checkpoint", "data")
TRAINER_CONTAINER = "trainer"


class WorkerEnvVar(_Model):
    """corev1.EnvVar: a literal ``value`` or a ``valueFrom`` (secretKeyRef, configMapKeyRef, fieldRef, ...)."""

    name: str = Field(min_length=1)
    value: str | None = None
    value_from: KubeObject | None = None

    @model_validator(mode="after")
    def _one(self) -> WorkerEnvVar:
        if self.value is not None and self.value_from is not None:
            raise ValueError(f"env {self.name}: set value or valueFrom, not both")
        return self


class TemplateMetadata(_Model):
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class WorkerTemplate(_Model):
    """A PodTemplateSpec overlay merged into every worker pod (see docs/kubernetes.md, Pod templates)."""

    metadata: TemplateMetadata = Field(default_factory=TemplateMetadata)
    spec: KubeObject = Field(
        default_factory=dict,
        description="a corev1.PodSpec fragment (not validated field by field here: the API server validates the "
                    "pods): containers merged by name (trainer = the operator's container, others are "
                    "sidecars), initContainers, volumes, tolerations, affinity, nodeSelector, priorityClassName, ...")

    @model_validator(mode="after")
    def _reserved(self) -> WorkerTemplate:
        spec = self.spec
        bad = [f"spec.{k}" for k in RESERVED_POD_FIELDS if k in spec]
        for i, c in enumerate(spec.get("containers") or []):
            if not isinstance(c, dict) or not c.get("name"):
                raise ValueError(f"template.spec.containers[{i}]: a container needs a name")
            if c["name"] == TRAINER_CONTAINER:
                bad += [f"spec.containers[trainer].{k}" for k in RESERVED_TRAINER_FIELDS if k in c]
                bad += [f"spec.containers[trainer].env {e.get('name')}" for e in c.get("env") or []
                        if isinstance(e, dict) and e.get("name") in RESERVED_WORKER_ENV]
        bad += [f"spec.volumes {v.get('name')}" for v in spec.get("volumes") or []
                if isinstance(v, dict) and v.get("name") in RESERVED_VOLUMES]
        if bad:
            raise ValueError(f"template sets what the operator sets: {', '.join(bad)} (image, command and "
                             f"args come from spec.image and the trainer config; reserved environment: "
                             f"{', '.join(RESERVED_WORKER_ENV)}; reserved volumes: {', '.join(RESERVED_VOLUMES)})")
        policy.check_template(spec)  # host namespaces, hostPath, privileged, root, service account
        return self


class Workers(_Model):
    replicas: Replicas = Field(1, description="pods in the job (nodes); nprocPerNode ranks each")
    nproc_per_node: int = Field(
        1, ge=1, description="ranks per pod (grstack train --nproc), one accelerator each: WORLD_SIZE = "
                             "replicas * nprocPerNode")
    accelerator: Accelerator = Field(
        "cpu", description="cpu, nvidia (nvidia.com/gpu) or ascend (huawei.com/Ascend910); one device per rank")
    resources: Resources = Field(default_factory=Resources)
    env: list[WorkerEnvVar] = Field(default_factory=list)
    env_from: list[KubeObject] = Field(default_factory=list, description="corev1.EnvFromSource items")
    template: WorkerTemplate = Field(default_factory=WorkerTemplate)

    @model_validator(mode="after")
    def _reserved_env(self) -> Workers:
        bad = [e.name for e in self.env if e.name in RESERVED_WORKER_ENV]
        if bad:
            raise ValueError(f"workers.env sets {', '.join(bad)}: the operator sets "
                             f"{', '.join(RESERVED_WORKER_ENV)} for every rank")
        policy.check_replicas("workers.replicas", self.replicas)
        return self


class TrainingData(_Model):
    claim_name: str | None = Field(None, description="PersistentVolumeClaim with datasets, mounted read-only")
    mount_path: str = "/data"
    format: str | None = Field(None, description="trainer data.format (parquet, recbole, ..., synth)")
    source: str | None = Field(None, description="trainer data.source: a path under mountPath, or a synth preset")


class TrainingCheckpoint(_Model):
    claim_name: str | None = Field(
        None, description="PersistentVolumeClaim for checkpoints (ReadWriteMany for several workers); "
                          "without it an emptyDir is used and a restarted gang starts over")
    mount_path: str = "/var/grstack/run"
    interval_steps: int | None = Field(None, ge=1, description="steps between checkpoints (train.checkpoint_every)")


class SchedulingPolicy(_Model):
    """Gang scheduling of the workers: a PodGroup for a gang scheduler, a Kueue queue, a schedule timeout."""

    gang_scheduler: Literal["None", "Coscheduling", "Volcano"] = Field(
        "None", description="Coscheduling: a scheduling.x-k8s.io/v1alpha1 PodGroup (scheduler-plugins) and the "
                            "pod label scheduling.x-k8s.io/pod-group; Volcano: a scheduling.volcano.sh/v1beta1 "
                            "PodGroup, the pod annotation scheduling.k8s.io/group-name and schedulerName volcano; "
                            "minMember = workers.replicas")
    queue: str | None = Field(None, description="Volcano queue of the PodGroup (gangScheduler Volcano)")
    kueue_queue_name: str | None = Field(
        None, description="Kueue LocalQueue: the operator queues the job through a kueue.x-k8s.io Workload and "
                          "creates its pods once Kueue admits it (default: the job's own "
                          "kueue.x-k8s.io/queue-name label)")
    schedule_timeout_seconds: int | None = Field(
        None, ge=1, description="a gang partly scheduled this long after its pods were created is released "
                                "(pods deleted, condition GangScheduled False ScheduleTimeout) and recreated")


class RunPolicy(_Model):
    backoff_limit: int = Field(3, ge=0, description="whole-gang restarts from the last checkpoint before Failed")
    active_deadline_seconds: int | None = Field(None, ge=1)
    ttl_seconds_after_finished: int | None = Field(None, ge=0, description="delete the job this long after it ends")
    clean_pod_policy: Literal["All", "Running", "None"] = Field(
        "None", description="pods deleted when the job ends: All, Running (still running ones) or None")
    suspend: bool = Field(False, description="true deletes the pods; false again resumes from the last checkpoint")
    scheduling_policy: SchedulingPolicy = Field(default_factory=SchedulingPolicy)


class GRTrainingJobSpec(_Model):
    """A change of ``workers.replicas`` is refused unless the job is (or becomes, in the same update) suspended:
    the ranks of a running gang cannot change their world size. Other fields that reach the pods restart the
    gang from its last checkpoint (condition reason ``SpecChanged``); ``runPolicy`` applies in place."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": "(self.workers.replicas == oldSelf.workers.replicas && self.workers.nprocPerNode == "
                 "oldSelf.workers.nprocPerNode) || self.runPolicy.suspend || oldSelf.runPolicy.suspend",
         "message": "workers.replicas and workers.nprocPerNode cannot change while the job runs: set "
                    "runPolicy.suspend to true first "
                    "(or in the same update), then resume"}]})

    image: str = Field(min_length=1, description="image with the grstack command")
    image_pull_policy: PullPolicy = "IfNotPresent"
    image_pull_secrets: list[str] = Field(default_factory=list)
    config: str | None = Field(None, description="trainer config YAML; default: the built-in synthetic demo")
    overrides: dict[str, Scalar] = Field(default_factory=dict, description="trainer --set key=value overrides")
    max_steps: int | None = Field(None, ge=1, description="train.max_steps")
    workers: Workers = Field(default_factory=Workers)
    data: TrainingData = Field(default_factory=TrainingData)
    checkpoint: TrainingCheckpoint = Field(default_factory=TrainingCheckpoint)
    run_policy: RunPolicy = Field(default_factory=RunPolicy)
    scheduling: Scheduling = Field(default_factory=Scheduling)
    progress_interval_seconds: int = Field(10, ge=1, description="how often rank 0 reports progress at most")


class Condition(_Model):
    """metav1.Condition."""

    type: str
    status: ConditionStatus
    reason: str
    message: str = ""
    last_transition_time: str
    observed_generation: int | None = None


class WorkerCounts(_Model):
    active: int = 0
    succeeded: int = 0
    failed: int = 0


class Progress(_Model):
    step: int | None = None
    total_steps: int | None = None
    epoch: int | None = None
    loss: float | None = None
    samples_per_second: float | None = None
    tokens_per_second: float | None = None
    last_checkpoint: str | None = None
    metrics: dict[str, float] | None = Field(None, description="test metrics reported when training finished")
    summary: str | None = Field(None, description="for humans and the Progress column, e.g. '40% (20/50)'")
    update_time: str | None = None


class ApiFailure(_Model):
    """The last write of a child the API server refused (kept after it recovers; see condition ReplicaFailure)."""

    time: str
    operation: str = Field(description="create or patch")
    kind: str
    name: str
    code: int = Field(description="the HTTP status of the refusal")
    reason: str = Field(description="the API's reason (Forbidden, Invalid, ...)")
    message: str = Field(description="the API's message")


class GRTrainingJobStatus(_Model):
    state: TrainingState | None = None
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    workers: WorkerCounts = Field(default_factory=WorkerCounts)
    restarts: int = 0
    disruptions: int = Field(0, description="gang restarts after a preemption, eviction or node drain "
                                            "(DisruptionTarget; not counted against backoffLimit)")
    retries: int | None = Field(None, description="consecutive reconcile passes whose writes the API refused")
    next_retry_time: str | None = Field(None, description="when the operator retries a refused write")
    last_failure: ApiFailure | None = None
    gang_attempt: int | None = Field(None, description="the attempt whose pods were all seen (a later gap is a loss)")
    gang_start_time: str | None = Field(None, description="when the current gang's pods were created")
    progress: Progress | None = None
    start_time: str | None = None
    completion_time: str | None = None
    observed_generation: int | None = None


# ----------------------------------------------------------------------------------------------- serving


class ServingCheckpoint(_Model):
    path: str = Field(min_length=1, description="exported checkpoint the rankers load (--checkpoint)")
    claim_name: str | None = Field(None, description="PersistentVolumeClaim holding it, mounted read-only")
    mount_path: str = "/models"


# A checkpoint given as a storage URI, as KServe's ``storageUri``: ``pvc://CLAIM/PATH`` is mounted read-only;
# ``s3://``, ``gs://`` and ``http(s)://`` are fetched into ``spec.storage.mountPath`` by an init container.
STORAGE_URI_PATTERN = r"^(pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/.*)?|(s3|gs)://[^/\s]+(/\S*)?|https?://\S+)$"
StorageUri = Annotated[str, Field(pattern=STORAGE_URI_PATTERN)]
# Either form in one structural schema (a field cannot have two types): no type, and value validations that
# tell the forms apart without one: an object needs ``path`` (and is no string: minLength 1 and maxLength 0
# together fail every string), a string needs the URI pattern (and is no object: ``required`` of a key an
# object form never has).
CHECKPOINT_SCHEMA = {
    "description": "the exported model the rankers load: {path, claimName, mountPath}, or a storage URI "
                   "string (pvc://CLAIM/PATH, s3://BUCKET/KEY, gs://BUCKET/KEY, https://...)",
    "x-kubernetes-preserve-unknown-fields": True,
    "allOf": [
        {"not": {"enum": [True, False]}},  # typeless keywords below cannot tell booleans apart
        {"anyOf": [
            {"required": ["path"], "minLength": 1, "maxLength": 0, "minimum": 0, "maximum": -1,
             "minItems": 1, "maxItems": 0},
            {"pattern": STORAGE_URI_PATTERN, "required": ["storageUri"], "minimum": 0, "maximum": -1,
             "minItems": 1, "maxItems": 0},
        ]},
    ],
}
Checkpoint = Annotated[ServingCheckpoint | StorageUri, WithJsonSchema(CHECKPOINT_SCHEMA)]


class Storage(_Model):
    """How a storage-URI checkpoint is fetched (unused with the object form or ``pvc://``)."""

    secret_name: str | None = Field(
        None, description="Secret with the credentials: its keys become the init container's environment "
                          "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, ...); it is also mounted "
                          "at /var/run/secrets/grstack-storage (gs://: a gcloud-application-credentials.json key)")
    initializer_image: str = Field("kserve/storage-initializer:v0.14.1",
                                   description="image that fetches URI into DIR when run with args [URI, DIR]")
    mount_path: str = Field("/mnt/models", description="where the fetched model lands in the ranker")
    size_limit: Quantity | None = Field(None, description="emptyDir size limit of the fetched model")


class DisruptionBudget(_Model):
    """A PodDisruptionBudget for rankers and one for routers (voluntary evictions: drains, upgrades)."""

    enabled: bool = True
    max_unavailable: IntOrPercent = Field(1, description="pods of each component that may be evicted at once: a "
                                                         "count or a percentage")


class Autoscaling(_Model):
    """A HorizontalPodAutoscaler on the GRRankingService scale subresource (ranker replicas)."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": "self.maxReplicas >= self.minReplicas", "message": "maxReplicas must be >= minReplicas"}]})

    min_replicas: Replicas = 1
    max_replicas: Replicas
    target_cpu_utilization_percentage: int = Field(80, ge=1, le=100, alias="targetCPUUtilizationPercentage")

    @model_validator(mode="after")
    def _bounds(self) -> Autoscaling:
        if self.max_replicas < self.min_replicas:
            raise ValueError("autoscaling.maxReplicas must be >= autoscaling.minReplicas")
        return self


class Ranker(_Model):
    port: int = Field(8000, ge=1, le=65535)
    accelerator: Accelerator = "cpu"
    resources: Resources = Field(default_factory=Resources)
    env: list[EnvVar] = Field(default_factory=list)


class Router(_Model):
    replicas: Replicas = 1
    port: int = Field(8080, ge=1, le=65535)
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    resources: Resources = Field(default_factory=Resources)
    env: list[EnvVar] = Field(default_factory=list)


class Cache(_Model):
    device_bytes: int = Field(1 << 30, ge=0, description="prefix KV cache held in accelerator memory per ranker")
    dram_bytes: int = Field(4 << 30, ge=0, description="host-DRAM tier for evicted prefixes per ranker")
    ttl_seconds: int = Field(600, ge=0, description="lifetime of a host-DRAM entry")


class Trigger(_Model):
    slo_ms: float = Field(50.0, gt=0, description="P99 latency budget the sequence-aware trigger protects")
    length_threshold: int | None = Field(
        None, ge=0, description="pre-infer histories at least this long (default: the router's latency model)")
    pre_infer_budget: float = Field(0.5, ge=0, le=1, description="share of ranker compute for pre-inference")


class EtcdTLS(_Model):
    """TLS from rankers and routers to an external etcd, from Secrets mounted as files (cert-manager's layout)."""

    ca_secret: str | None = Field(None, min_length=1, description="Secret whose ca.crt signed etcd's server "
                                                                  "certificate (default: the system roots)")
    client_cert_secret: str | None = Field(
        None, min_length=1, description="kubernetes.io/tls Secret (tls.crt, tls.key): the client certificate for "
                                        "an etcd with --client-cert-auth")


class EtcdPasswordAuth(_Model):
    """etcd password authentication; the password is read from a Secret mounted as a file."""

    user: str = Field(min_length=1, description="etcd user")
    password_secret: str = Field(min_length=1, description="Secret holding the user's password")
    password_key: str = Field("password", min_length=1, description="key of the password in passwordSecret")


class Etcd(_Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{
        "rule": "(!has(self.tls) && !has(self.auth)) || (has(self.endpoints) && size(self.endpoints) > 0)",
        "message": "etcd.tls and etcd.auth need etcd.endpoints (an external etcd; the managed one serves plain "
                   "HTTP)"}]})

    endpoints: list[str] = Field(default_factory=list, description="existing etcd client URLs (the first is used)")
    managed: bool = Field(False, description="run a one-member etcd owned by this service")
    image: str = "quay.io/coreos/etcd:v3.5.17"
    tls: EtcdTLS | None = Field(None, description="TLS to etcd (https:// endpoints, or a CA / client certificate)")
    auth: EtcdPasswordAuth | None = Field(None, description="etcd user and password")
    placement_ttl_seconds: int | None = Field(
        None, ge=0, alias="placementTTLSeconds",
        description="a stored placement expires this long after its last prefill; 0: it lives as long as its "
                    "ranker's lease (default: the router's, 3600)")


OpenPath = Annotated[str, Field(pattern=r"^/?[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$")]
PROBE_PATHS = ("healthz", "readyz")


class ServingAuth(_Model):
    """Bearer tokens for routers and rankers, from Secrets mounted as files (re-read when the Secret changes)."""

    token_secret: str = Field(min_length=1, description="Secret holding the tokens clients present to the routers "
                                                        "(one a line, at least 16 characters each)")
    token_key: str = Field("tokens", min_length=1, description="key of the tokens in tokenSecret")
    ranker_token_secret: str | None = Field(
        None, min_length=1, description="Secret holding the tokens rankers accept; routers send its first one "
                                        "(default: tokenSecret)")
    ranker_token_key: str = Field("tokens", min_length=1, description="key of the tokens in rankerTokenSecret")
    open_paths: list[OpenPath] = Field(
        default_factory=lambda: list(PROBE_PATHS),
        description="paths served without a token or client certificate; healthz and readyz (the kubelet's "
                    "probes) must be among them; add metrics for Prometheus without a token, v1/stats for "
                    "status.cacheHitRate")


class ServingTLS(_Model):
    """HTTPS for routers and rankers from a kubernetes.io/tls Secret (cert-manager's layout: tls.crt, tls.key,
    ca.crt). The certificate must name the rankers' Service (``<name>-ranker``: routers verify rankers
    against it) and the names clients use for the routers (``<name>``, ``<name>.<namespace>.svc``)."""

    secret_name: str = Field(min_length=1, description="kubernetes.io/tls Secret with tls.crt, tls.key and ca.crt")
    client_auth: bool = Field(False, description="rankers require a client certificate signed by ca.crt on every "
                                                 "path but the open ones; routers present the Secret's (mTLS: "
                                                 "the certificate needs the client auth usage too)")


class GRRankingServiceSpec(_Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{
        "rule": "!has(self.autoscaling) || (has(self.ranker) && has(self.ranker.resources) && "
                "has(self.ranker.resources.requests) && 'cpu' in self.ranker.resources.requests)",
        "message": "autoscaling needs ranker.resources.requests.cpu"}, {
        "rule": "!has(self.router) || !has(self.router.serviceType) || self.router.serviceType == 'ClusterIP' || "
                "has(self.auth)",
        "message": "router.serviceType LoadBalancer or NodePort exposes the routers outside the cluster: set auth "
                   "(bearer tokens)"}]})

    image: str = Field(min_length=1)
    image_pull_policy: PullPolicy = "IfNotPresent"
    image_pull_secrets: list[str] = Field(default_factory=list)
    checkpoint: Checkpoint
    storage: Storage = Field(default_factory=Storage)
    replicas: Replicas = Field(1, description="ranker replicas (the scale subresource)")
    autoscaling: Autoscaling | None = None
    ranker: Ranker = Field(default_factory=Ranker)
    router: Router = Field(default_factory=Router)
    cache: Cache = Field(default_factory=Cache)
    trigger: Trigger = Field(default_factory=Trigger)
    etcd: Etcd = Field(default_factory=Etcd)
    scheduling: Scheduling = Field(default_factory=Scheduling)
    disruption_budget: DisruptionBudget = Field(default_factory=DisruptionBudget)
    hit_rate_window_seconds: int = Field(300, ge=10, description="window of status.cacheHitRate")
    auth: ServingAuth | None = Field(None, description="bearer tokens on routers and rankers (required with "
                                                       "router.serviceType LoadBalancer or NodePort)")
    tls: ServingTLS | None = Field(None, description="HTTPS on routers and rankers, optionally mTLS between them")

    @model_validator(mode="after")
    def _etcd(self) -> GRRankingServiceSpec:
        policy.check_replicas("replicas", self.replicas)
        policy.check_replicas("router.replicas", self.router.replicas)
        if self.autoscaling is not None:
            policy.check_replicas("autoscaling.maxReplicas", self.autoscaling.max_replicas)
        if self.etcd.managed and self.etcd.endpoints:
            raise ValueError("etcd: set either managed or endpoints, not both")
        if not self.etcd.endpoints and (self.etcd.tls is not None or self.etcd.auth is not None):
            raise ValueError("etcd.tls and etcd.auth need etcd.endpoints (an external etcd; the managed one serves "
                             "plain HTTP)")
        if self.autoscaling is not None and "cpu" not in self.ranker.resources.requests:
            # The HPA's CPU utilization is relative to the request: without one it never scales.
            raise ValueError("autoscaling needs ranker.resources.requests.cpu (the HPA's CPU utilization is a "
                             "share of the request)")
        if self.router.service_type != "ClusterIP" and self.auth is None:
            raise ValueError(f"router.serviceType {self.router.service_type} exposes the routers outside the cluster: "
                             f"set auth (bearer tokens)")
        if self.auth is not None or (self.tls is not None and self.tls.client_auth):
            opened = {p.strip("/") for p in self.open_paths}
            missing = [p for p in PROBE_PATHS if p not in opened]
            if missing:
                raise ValueError(f"auth.openPaths must include {' and '.join(missing)}: the kubelet's probes carry "
                                 f"no token or client certificate")
        return self

    @property
    def open_paths(self) -> list[str]:
        return list(self.auth.open_paths) if self.auth is not None else list(PROBE_PATHS)


class GRRankingServiceStatus(_Model):
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    replicas: int = 0
    ready_replicas: int = 0
    router_ready_replicas: int = 0
    url: str | None = None
    cache_hit_rate: float | None = Field(None, description="prefix-cache hit rate over the last "
                                                           "spec.hitRateWindowSeconds (all rankers)")
    updated_replicas: int = Field(0, description="ranker replicas at the current revision")
    selector: str | None = Field(None, description="ranker pod selector (scale subresource)")
    retries: int | None = Field(None, description="consecutive reconcile passes whose writes the API refused")
    next_retry_time: str | None = Field(None, description="when the operator retries a refused write")
    last_failure: ApiFailure | None = None
    observed_generation: int | None = None
