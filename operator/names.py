"""API group, label and annotation keys, and child-object names shared by the operator, the trainer and tests.

Names are derived deterministically from the owning resource so a reconcile pass can find (and recreate)
its children without storing anything: ``<job>-worker-<rank>`` pods behind a ``<job>-workers`` headless
Service, ``<svc>-ranker-<i>`` StatefulSet pods, and so on.
"""

from __future__ import annotations

import re

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

# Resource names. Children are named ``<name><suffix>`` and several become DNS labels (Service names, pod
# hostnames) or label values, so a name must be a DNS-1035 label (what a Service name must be) short enough
# that its longest derived name still fits in 63 characters.
DNS_LABEL_MAX = 63
DNS_1035_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
MAX_REPLICAS = 1000  # hard ceiling of workers.replicas and the serving replicas (the CRDs' maximum)
# The StatefulSet controller labels each pod controller-revision-hash=<statefulset>-<hash of up to 10
# characters>, a label value (at most 63): for the rankers that is "<name>-ranker-" plus the hash.
REVISION_HASH_LENGTH = 10
CHILD_SUFFIXES = (
    "-workers", "-config", "-worker",  # training: headless Service, ConfigMap, ServiceAccount/Role
    f"-worker-{MAX_REPLICAS - 1}",  # training: the last worker pod (its name is also its hostname)
    "-ranker", "-router", "-etcd",  # serving: StatefulSet + Service, Deployment, managed etcd
    f"-ranker-{'x' * REVISION_HASH_LENGTH}",  # serving: the rankers' controller-revision-hash label value
    f"-etcd-{'x' * REVISION_HASH_LENGTH}",
)
MAX_NAME_LENGTH = DNS_LABEL_MAX - max(len(s) for s in CHILD_SUFFIXES)


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


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a GRTrainingJob or GRRankingService (the CRDs' CEL rules say the same), or None."""
    if len(name) > MAX_NAME_LENGTH:
        return (f"metadata.name: {len(name)} characters, at most {MAX_NAME_LENGTH}: the names derived from it "
                f"(<name>-ranker-<hash>, <name>-worker-<rank>) must fit in {DNS_LABEL_MAX}")
    if not re.match(DNS_1035_PATTERN, name):
        return (f"metadata.name: {name!r} is not a DNS-1035 label (lowercase letters, digits and '-', starting "
                f"with a letter and ending with a letter or digit): it names Services and pod hostnames")
    return None
