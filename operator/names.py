"""API group, label and annotation keys, and child-object names shared by the operator, the trainer and tests.

Names are derived deterministically from the owning resource so a reconcile pass can find (and recreate)
its children without storing anything: ``<job>-worker-<rank>`` pods behind a ``<job>-workers`` headless
Service, ``<svc>-ranker-<i>`` StatefulSet pods, and so on.
"""

from __future__ import annotations

GROUP = "grstack.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

TRAINING_KIND = "GRTrainingJob"
TRAINING_PLURAL = "grtrainingjobs"
SERVING_KIND = "GRRankingService"
SERVING_PLURAL = "grrankingservices"

# Labels on every child object.
LABEL_NAME = "app.kubernetes.io/name"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_JOB = f"{GROUP}/job-name"
LABEL_SERVICE = f"{GROUP}/service-name"
LABEL_RANK = f"{GROUP}/replica-index"
LABEL_ATTEMPT = f"{GROUP}/attempt"
MANAGED_BY = "grstack-operator"

# Rank 0 writes its progress (JSON) into this annotation on its own Pod; the operator copies it to status.
ANNOTATION_PROGRESS = f"{GROUP}/progress"

# Paths inside worker pods.
CONFIG_MOUNT = "/etc/grstack/train"
CONFIG_KEY = "config.yaml"
MASTER_PORT = 29500
MAX_NAME_LENGTH = 45  # leaves room for "-worker-NNN" and "-workers" within the 63-character DNS label


def worker_pod_name(job: str, rank: int) -> str:
    return f"{job}-worker-{rank}"


def workers_service_name(job: str) -> str:
    return f"{job}-workers"


def job_config_name(job: str) -> str:
    return f"{job}-config"


def job_account_name(job: str) -> str:
    return f"{job}-worker"


def ranker_name(service: str) -> str:
    return f"{service}-ranker"


def router_name(service: str) -> str:
    return f"{service}-router"


def etcd_name(service: str) -> str:
    return f"{service}-etcd"
