"""Pure reconcile of a GRRankingService: (service, observed children, pods, cache stats) -> children, status.

Children (all owned by the GRRankingService, re-applied every pass so spec changes and scaling propagate):

- rankers (``grstack serve ranker``): a StatefulSet behind a headless Service, so replica ``i`` keeps its
  name and DNS address across restarts (``--rankers`` lists and consistent hashing stay stable; etcd
  placements point at it);
- routers (``grstack serve router``): a Deployment behind the Service named like the GRRankingService (its
  URL goes to the status);
- PodDisruptionBudgets for rankers and routers;
- optionally a one-member etcd StatefulSet + Service, and a HorizontalPodAutoscaler on the scale
  subresource.

The checkpoint is a path (optionally on a PVC) or a storage URI: ``pvc://`` is mounted, ``s3://``,
``gs://`` and ``http(s)://`` are fetched into an emptyDir by an init container. Nothing in the router's pod
template depends on the ranker count (routers discover rankers through etcd or the headless Service), so
scaling rankers never rolls the routers.

Rankers and routers need no Kubernetes API access (no service-account token). Cache budgets and trigger
settings become their command-line flags; with etcd, each service keeps its placements under its own key
prefix, so several services can share one etcd.

Status: ``Ready`` follows the rollout of rankers and routers (current spec, generation observed, replicas
updated and available) and the managed etcd; ready replicas; URL; the prefix-cache hit rate over a window
(the rankers' ``GET /v1/stats`` counters, polled by the operator); the selector for the scale subresource.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from grstack.operator import names, objects
from grstack.operator.models import GRRankingServiceSpec, ServingCheckpoint

ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
MB = 1 << 20
DEVICE_FLAGS = {"cpu": "cpu", "nvidia": "cuda", "ascend": "npu"}
STORAGE_SECRET_PATH = "/var/run/secrets/grstack-storage"


@dataclass
class ServingPlan:
    status: dict[str, Any]
    children: list[dict[str, Any]] = field(default_factory=list)  # created, or patched when they differ
    delete: list[tuple[str, str, str]] = field(default_factory=list)  # (apiVersion, kind, name) no longer wanted
    events: list[tuple[str, str, str]] = field(default_factory=list)


def labels(service: str, component: str) -> dict[str, str]:
    return {
        names.LABEL_NAME: "grstack",
        names.LABEL_MANAGED_BY: names.MANAGED_BY,
        names.LABEL_COMPONENT: component,
        names.LABEL_SERVICE: service,
    }


def selector(service: str, component: str) -> dict[str, str]:
    return {names.LABEL_SERVICE: service, names.LABEL_COMPONENT: component}


def selector_string(service: str, component: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector(service, component).items())


def etcd_endpoint(service: str, spec: GRRankingServiceSpec) -> str | None:
    if spec.etcd.managed:
        return f"http://{names.etcd_name(service)}:{ETCD_CLIENT_PORT}"
    return spec.etcd.endpoints[0] if spec.etcd.endpoints else None


def etcd_root(namespace: str, service: str) -> str:
    return f"/grstack/ranking/{namespace}/{service}"


ETCD_SECRETS_PATH = "/var/run/secrets/grstack-etcd"


def etcd_client(spec: GRRankingServiceSpec) -> tuple[list[str], list[dict[str, Any]], list[dict[str, Any]]]:
    """The etcd TLS/auth flags of rankers and routers, and the Secret volumes and mounts behind them."""
    e = spec.etcd
    flags: list[str] = []
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []

    def secret(name: str, secret_name: str, items: dict[str, str]) -> str:
        path = f"{ETCD_SECRETS_PATH}/{name.removeprefix('etcd-')}"
        volumes.append({"name": name, "secret": {"secretName": secret_name, "defaultMode": 0o440,
                                                 "items": [{"key": k, "path": v} for k, v in items.items()]}})
        mounts.append({"name": name, "mountPath": path, "readOnly": True})
        return path

    if e.tls is not None and e.tls.ca_secret:
        flags += ["--etcd-ca", secret("etcd-ca", e.tls.ca_secret, {"ca.crt": "ca.crt"}) + "/ca.crt"]
    if e.tls is not None and e.tls.client_cert_secret:
        path = secret("etcd-client", e.tls.client_cert_secret, {"tls.crt": "tls.crt", "tls.key": "tls.key"})
        flags += ["--etcd-cert", f"{path}/tls.crt", "--etcd-key", f"{path}/tls.key"]
    if e.auth is not None:
        path = secret("etcd-auth", e.auth.password_secret, {e.auth.password_key: "password"})
        flags += ["--etcd-user", e.auth.user, "--etcd-password-file", f"{path}/password"]
    return flags, volumes, mounts


SERVING_SECRETS_PATH = "/var/run/secrets/grstack-serving"


def scheme(spec: GRRankingServiceSpec) -> str:
    return "https" if spec.tls is not None else "http"


def serving_security(service: str, spec: GRRankingServiceSpec, component: str) -> tuple[
        list[str], list[dict[str, Any]], list[dict[str, Any]]]:
    """The token, TLS and open-path flags of a ranker or router (``component``), and the Secret volumes and
    mounts behind them. Rankers accept the ranker tokens; routers accept the client tokens and send the first
    ranker token; with ``tls.clientAuth`` rankers require the routers' certificate (the same Secret's)."""
    auth, tls = spec.auth, spec.tls
    flags: list[str] = []
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []

    def secret(name: str, secret_name: str, items: dict[str, str]) -> str:
        path = f"{SERVING_SECRETS_PATH}/{name}"
        volumes.append({"name": name, "secret": {"secretName": secret_name, "defaultMode": 0o440,
                                                 "items": [{"key": k, "path": v} for k, v in items.items()]}})
        mounts.append({"name": name, "mountPath": path, "readOnly": True})
        return path

    if auth is not None:
        ranker_secret = auth.ranker_token_secret or auth.token_secret
        ranker_key = auth.ranker_token_key if auth.ranker_token_secret else auth.token_key
        if component == "router":
            client_tokens = secret("serving-tokens", auth.token_secret, {auth.token_key: "tokens"}) + "/tokens"
            same = (ranker_secret, ranker_key) == (auth.token_secret, auth.token_key)
            ranker_tokens = client_tokens if same else \
                secret("ranker-tokens", ranker_secret, {ranker_key: "tokens"}) + "/tokens"
            flags += ["--auth-token-file", client_tokens, "--ranker-token-file", ranker_tokens]
        else:
            flags += ["--auth-token-file", secret("ranker-tokens", ranker_secret, {ranker_key: "tokens"}) + "/tokens"]
    if auth is not None or (tls is not None and tls.client_auth):
        flags += ["--open-paths", ",".join(spec.open_paths)]
    if tls is not None:
        path = secret("serving-tls", tls.secret_name, {"tls.crt": "tls.crt", "tls.key": "tls.key", "ca.crt": "ca.crt"})
        flags += ["--tls-cert", f"{path}/tls.crt", "--tls-key", f"{path}/tls.key"]
        if component == "router":
            flags += ["--ranker-ca", f"{path}/ca.crt", "--ranker-server-name", names.ranker_name(service)]
            if tls.client_auth:
                flags += ["--ranker-cert", f"{path}/tls.crt", "--ranker-key", f"{path}/tls.key"]
        elif tls.client_auth:
            flags += ["--tls-client-ca", f"{path}/ca.crt"]
    return flags, volumes, mounts


def ranker_urls(service: str, spec: GRRankingServiceSpec) -> list[str]:
    sts = names.ranker_name(service)
    return [f"{scheme(spec)}://{sts}-{i}.{sts}:{spec.ranker.port}" for i in range(spec.replicas)]


def url(service: str, namespace: str, spec: GRRankingServiceSpec) -> str:
    return f"{scheme(spec)}://{service}.{namespace}.svc:{spec.router.port}"


@dataclass
class ModelSource:
    """Where the rankers find the checkpoint: the --checkpoint path, its volume and mount, init containers."""

    path: str
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    init_containers: list[dict[str, Any]] = field(default_factory=list)


def model_source(spec: GRRankingServiceSpec) -> ModelSource:
    ckpt = spec.checkpoint
    if isinstance(ckpt, ServingCheckpoint):
        if not ckpt.claim_name:
            return ModelSource(ckpt.path)
        return ModelSource(
            ckpt.path, [{"name": "model", "persistentVolumeClaim": {"claimName": ckpt.claim_name, "readOnly": True}}],
            [{"name": "model", "mountPath": ckpt.mount_path, "readOnly": True}])
    st = spec.storage
    scheme, _, rest = ckpt.partition("://")
    mount = {"name": "model", "mountPath": st.mount_path, "readOnly": True}
    if scheme == "pvc":  # mounted, as KServe does: pvc://CLAIM/PATH -> MOUNT/PATH
        claim, _, sub = rest.partition("/")
        return ModelSource(f"{st.mount_path.rstrip('/')}/{sub}" if sub else st.mount_path,
                           [{"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}],
                           [mount])
    # s3/gs/http(s): fetched into an emptyDir before the ranker starts. A URI naming a file lands under its
    # base name; a prefix's contents land in the directory (the ranker finds model.pt in it).
    base = rest.split("?", 1)[0].rstrip("/").rpartition("/")[2]
    path = f"{st.mount_path.rstrip('/')}/{base}" if "/" in rest.strip("/") and "." in base else st.mount_path
    empty: dict[str, Any] = {"sizeLimit": st.size_limit} if st.size_limit is not None else {}
    volumes = [{"name": "model", "emptyDir": empty}]
    init: dict[str, Any] = {
        "name": "storage-initializer",
        "image": st.initializer_image,
        "imagePullPolicy": spec.image_pull_policy,
        "args": [ckpt, st.mount_path],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "volumeMounts": [{"name": "model", "mountPath": st.mount_path}, {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": objects.container_security_context(),
    }
    if st.secret_name:
        init["envFrom"] = [{"secretRef": {"name": st.secret_name}}]
        volumes.append({"name": "storage-secret", "secret": {"secretName": st.secret_name}})
        init["volumeMounts"].append({"name": "storage-secret", "mountPath": STORAGE_SECRET_PATH, "readOnly": True})
        if scheme == "gs":
            init["env"].append({"name": "GOOGLE_APPLICATION_CREDENTIALS",
                                "value": f"{STORAGE_SECRET_PATH}/gcloud-application-credentials.json"})
    return ModelSource(path, volumes, [mount], [init])


def _mb(n: int) -> str:
    return f"{n / MB:g}"


def ranker_args(service: str, namespace: str, spec: GRRankingServiceSpec) -> list[str]:
    sts, c = names.ranker_name(service), spec.cache
    args = ["serve", "ranker", "--checkpoint", model_source(spec).path, "--host", "0.0.0.0",
            "--port", str(spec.ranker.port), "--device", DEVICE_FLAGS[spec.ranker.accelerator],
            "--device-cache-mb", _mb(c.device_bytes), "--dram-cache-mb", _mb(c.dram_bytes),
            "--dram-ttl-s", str(c.ttl_seconds)]
    endpoint = etcd_endpoint(service, spec)
    if endpoint:
        args += ["--etcd", endpoint, "--etcd-root", etcd_root(namespace, service),
                 "--replica-id", "$(GRSTACK_POD_NAME)",
                 "--advertise-url", f"{scheme(spec)}://$(GRSTACK_POD_NAME).{sts}:{spec.ranker.port}",
                 *etcd_client(spec)[0]]
    return args + serving_security(service, spec, "ranker")[0]


def router_args(service: str, namespace: str, spec: GRRankingServiceSpec) -> list[str]:
    """Nothing here depends on the ranker count, so scaling rankers never rolls the routers: they find the
    rankers in etcd or as the addresses of the rankers' headless Service (ready pods only), and the budgets
    are per ranker (the router multiplies them by the rankers it sees up)."""
    endpoint = etcd_endpoint(service, spec)
    source = ["--etcd", endpoint, "--etcd-root", etcd_root(namespace, service)] if endpoint else \
        ["--rankers-dns", f"{names.ranker_name(service)}:{spec.ranker.port}"]
    t, c = spec.trigger, spec.cache
    args = ["serve", "router", *source, "--host", "0.0.0.0", "--port", str(spec.router.port),
            "--slo-ms", f"{t.slo_ms:g}", "--prefill-budget-ms", f"{1000 * t.pre_infer_budget:g}",
            # Admitted prefixes must fit the rankers' device caches together.
            "--cache-budget-per-replica-mb", _mb(c.device_bytes), "--footprint-ttl-s", str(c.ttl_seconds)]
    if t.length_threshold is not None:
        args += ["--length-threshold", str(t.length_threshold)]
    if endpoint:
        args += etcd_client(spec)[0]
    if spec.etcd.placement_ttl_seconds is not None:
        args += ["--placement-ttl-s", str(spec.etcd.placement_ttl_seconds)]
    return args + serving_security(service, spec, "router")[0]


def _probes(port: int, https: bool = False) -> dict[str, Any]:
    """The kubelet's probes (over HTTPS with TLS: the kubelet does not verify the certificate)."""
    tls: dict[str, Any] = {"scheme": "HTTPS"} if https else {}
    return {
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": port, **tls}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": port, **tls}, "initialDelaySeconds": 30,
                          "periodSeconds": 10, "failureThreshold": 6},
    }


def _pod_spec(spec: GRRankingServiceSpec, container: dict[str, Any], volumes: list[dict[str, Any]],
              init_containers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": objects.pod_security_context(),
        "containers": [container],
        "volumes": volumes,
    }
    if init_containers:
        pod["initContainers"] = init_containers
    if spec.image_pull_secrets:
        pod["imagePullSecrets"] = objects.pull_secrets(spec.image_pull_secrets)
    objects.apply_scheduling(pod, spec.scheduling)
    return pod


def _container(spec: GRRankingServiceSpec, name: str, args: list[str], port: int, env: list[dict[str, Any]],
               mounts: list[dict[str, Any]], resources: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": name,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["grstack"],
        "args": args,
        "env": env,
        "ports": [{"name": "http", "containerPort": port}],
        "volumeMounts": mounts,
        "securityContext": objects.container_security_context(),
        **_probes(port, spec.tls is not None),
    }
    if resources:
        container["resources"] = resources
    return container


def children(svc: dict[str, Any], spec: GRRankingServiceSpec) -> list[dict[str, Any]]:
    name, namespace = svc["metadata"]["name"], svc["metadata"]["namespace"]
    ranker, router = names.ranker_name(name), names.router_name(name)
    out: list[dict[str, Any]] = []
    volumes, mounts = objects.scratch_volumes()
    common_env = [objects.field_env("GRSTACK_POD_NAME", "metadata.name"),
                  objects.field_env("GRSTACK_POD_NAMESPACE", "metadata.namespace"), *objects.SCRATCH_ENV]

    # Rankers.
    source = model_source(spec)
    _, e_volumes, e_mounts = etcd_client(spec) if etcd_endpoint(name, spec) else ([], [], [])
    _, rs_volumes, rs_mounts = serving_security(name, spec, "ranker")
    _, ts_volumes, ts_mounts = serving_security(name, spec, "router")
    r_volumes = volumes + source.volumes + e_volumes + rs_volumes
    r_mounts = mounts + source.mounts + e_mounts + rs_mounts
    r_container = _container(spec, "ranker", ranker_args(name, namespace, spec), spec.ranker.port,
                             [*common_env, *objects.env_list(spec.ranker.env)], r_mounts,
                             objects.resources(spec.ranker.resources, spec.ranker.accelerator))
    r_labels = labels(name, "ranker")
    out.append({
        "apiVersion": "v1", "kind": "Service",
        "metadata": objects.metadata(svc, ranker, r_labels),
        "spec": {"clusterIP": "None", "selector": selector(name, "ranker"),
                 "ports": [{"name": "http", "port": spec.ranker.port, "targetPort": spec.ranker.port}]},
    })
    out.append({
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": objects.metadata(svc, ranker, r_labels),
        "spec": {
            "replicas": spec.replicas,
            "serviceName": ranker,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector(name, "ranker")},
            "template": {"metadata": {"labels": r_labels},
                         "spec": _pod_spec(spec, r_container, r_volumes, source.init_containers)},
        },
    })

    # Routers.
    t_container = _container(spec, "router", router_args(name, namespace, spec), spec.router.port,
                             [*common_env, *objects.env_list(spec.router.env)], mounts + e_mounts + ts_mounts,
                             objects.resources(spec.router.resources, "cpu"))
    t_labels = labels(name, "router")
    out.append({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": objects.metadata(svc, router, t_labels),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": selector(name, "router")},
            "template": {"metadata": {"labels": t_labels},
                         "spec": _pod_spec(spec, t_container, volumes + e_volumes + ts_volumes)},
        },
    })
    out.append({
        "apiVersion": "v1", "kind": "Service",
        "metadata": objects.metadata(svc, name, t_labels),
        "spec": {"type": spec.router.service_type, "selector": selector(name, "router"),
                 "ports": [{"name": "http", "port": spec.router.port, "targetPort": spec.router.port}]},
    })

    if spec.disruption_budget.enabled:
        for component, obj_name, obj_labels in (("ranker", ranker, r_labels), ("router", router, t_labels)):
            out.append({
                "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                "metadata": objects.metadata(svc, obj_name, obj_labels),
                "spec": {"maxUnavailable": spec.disruption_budget.max_unavailable,
                         "selector": {"matchLabels": selector(name, component)}},
            })
    if spec.etcd.managed:
        out += _etcd(svc, spec)
    if spec.autoscaling:
        a = spec.autoscaling
        out.append({
            "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": objects.metadata(svc, ranker, r_labels),
            "spec": {
                "scaleTargetRef": {"apiVersion": names.API_VERSION, "kind": names.SERVING_KIND, "name": name},
                "minReplicas": a.min_replicas,
                "maxReplicas": a.max_replicas,
                "metrics": [{"type": "Resource", "resource": {
                    "name": "cpu", "target": {"type": "Utilization",
                                              "averageUtilization": a.target_cpu_utilization_percentage}}}],
            },
        })
    return out


def _etcd(svc: dict[str, Any], spec: GRRankingServiceSpec) -> list[dict[str, Any]]:
    """One etcd member; placements are soft state (routers fall back to the hash ring), so an emptyDir."""
    name = svc["metadata"]["name"]
    etcd = names.etcd_name(name)
    e_labels = labels(name, "etcd")
    container = {
        "name": "etcd",
        "image": spec.etcd.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["etcd"],
        "args": [
            "--name=$(POD_NAME)",
            "--data-dir=/var/run/etcd/data",
            f"--listen-client-urls=http://0.0.0.0:{ETCD_CLIENT_PORT}",
            f"--advertise-client-urls=http://{etcd}:{ETCD_CLIENT_PORT}",
            f"--listen-peer-urls=http://0.0.0.0:{ETCD_PEER_PORT}",
            f"--initial-advertise-peer-urls=http://$(POD_NAME).{etcd}:{ETCD_PEER_PORT}",
            f"--initial-cluster=$(POD_NAME)=http://$(POD_NAME).{etcd}:{ETCD_PEER_PORT}",
        ],
        "env": [objects.field_env("POD_NAME", "metadata.name")],
        "ports": [{"name": "client", "containerPort": ETCD_CLIENT_PORT},
                  {"name": "peer", "containerPort": ETCD_PEER_PORT}],
        "volumeMounts": [{"name": "data", "mountPath": "/var/run/etcd"}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": ETCD_CLIENT_PORT}, "periodSeconds": 5},
        "securityContext": objects.container_security_context(),
    }
    return [
        {"apiVersion": "v1", "kind": "Service", "metadata": objects.metadata(svc, etcd, e_labels),
         "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": selector(name, "etcd"),
                  "ports": [{"name": "client", "port": ETCD_CLIENT_PORT},
                            {"name": "peer", "port": ETCD_PEER_PORT}]}},
        {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": objects.metadata(svc, etcd, e_labels),
         "spec": {"replicas": 1, "serviceName": etcd, "selector": {"matchLabels": selector(name, "etcd")},
                  "template": {"metadata": {"labels": e_labels},
                               "spec": {"enableServiceLinks": False, "automountServiceAccountToken": False,
                                        "securityContext": objects.pod_security_context(),
                                        "containers": [container],
                                        "volumes": [{"name": "data", "emptyDir": {}}]}}}},
    ]


def stats_targets(svc: dict[str, Any], pods: list[dict[str, Any]]) -> list[str]:
    """``/v1/stats`` URLs of the running ranker pods (the operator polls them for the hit rate)."""
    spec = svc.get("spec") or {}
    try:
        port = int((spec.get("ranker") or {}).get("port") or 8000)
    except (TypeError, ValueError):
        return []
    # With TLS the poll goes over HTTPS (unverified: the operator holds no Secrets, and reads counters only);
    # with auth only an open v1/stats answers it.
    proto = "https" if spec.get("tls") else "http"
    out = []
    for pod in pods:
        ip = (pod.get("status") or {}).get("podIP")
        if pod.get("metadata", {}).get("labels", {}).get(names.LABEL_COMPONENT) == "ranker" and ip \
                and objects.phase(pod) == "Running" and not objects.terminating(pod):
            host = f"[{ip}]" if ":" in ip else ip
            out.append(f"{proto}://{host}:{port}/v1/stats")
    return out


def hit_rate(stats: list[dict[str, Any]]) -> float | None:
    """Prefix-cache hit rate over rankers: (device + DRAM hits) / (hits + misses), None before any lookup."""
    hits = lookups = 0
    for s in stats:
        try:
            h = int(s.get("device_hits", 0)) + int(s.get("dram_hits", 0))
            m = int(s.get("misses", 0))
        except (TypeError, ValueError, AttributeError):
            continue
        hits += h
        lookups += h + m
    return round(hits / lookups, 4) if lookups else None


Counters = dict[str, tuple[int, int]]  # ranker -> (hits, lookups) since that ranker started


def counters(stats: list[dict[str, Any]]) -> Counters:
    """Per-ranker cumulative counters; a ranker is named by the ``_target`` the operator polled (else its index)."""
    out: Counters = {}
    for i, s in enumerate(stats):
        try:
            h = int(s.get("device_hits", 0)) + int(s.get("dram_hits", 0))
            m = int(s.get("misses", 0))
        except (TypeError, ValueError, AttributeError):
            continue
        out[str(s.get("_target", i))] = (h, h + m)
    return out


@dataclass
class HitRateWindow:
    """The hit rate over the last ``seconds``: the counters now minus those at the window's start, per ranker.
    A ranker whose counters went down restarted; one that is new has no baseline: its counters since start
    count (they all fall in the window or a little before)."""

    seconds: float = 300.0
    samples: list[tuple[float, Counters]] = field(default_factory=list)

    def add(self, t: float, current: Counters) -> tuple[bool, float | None]:
        """(known, rate): known is False until a baseline exists; rate is None when nothing was looked up."""
        self.samples.append((t, current))
        # Keep the newest sample at or before the window's start as the baseline.
        while len(self.samples) > 2 and self.samples[1][0] <= t - self.seconds:
            self.samples.pop(0)
        if len(self.samples) < 2:
            return False, None
        base = self.samples[0][1]
        hits = lookups = 0
        for key, (h, n) in current.items():
            h0, n0 = base.get(key, (0, 0))
            if h < h0 or n < n0:
                h0 = n0 = 0
            hits += h - h0
            lookups += n - n0
        return True, (round(hits / lookups, 4) if lookups > 0 else None)


def _status(obj: dict[str, Any] | None) -> dict[str, Any]:
    return (obj or {}).get("status") or {}


def _ready(obj: dict[str, Any] | None) -> int:
    return int(_status(obj).get("readyReplicas") or 0)


def rollout(desired: dict[str, Any], live: dict[str, Any] | None, want: int) -> tuple[bool, str]:
    """Whether a StatefulSet/Deployment has rolled out ``desired``: its live spec is the desired one, the
    controller has seen the current generation, and ``want`` replicas are updated and available with no old
    ones left."""
    kind = desired["kind"]
    if live is None:
        return False, f"{kind} not created yet"
    if "spec" in live and not objects.covers(desired["spec"], live["spec"]):  # quantities by value
        return False, f"{kind} being updated"
    st = _status(live)
    generation = (live.get("metadata") or {}).get("generation")
    if generation is not None and int(st.get("observedGeneration") or 0) < int(generation):
        return False, f"{kind} generation {generation} not observed yet"
    updated = int(st.get("updatedReplicas") or 0)
    available = int(st.get("availableReplicas", st.get("readyReplicas")) or 0)
    total = int(st.get("replicas") or 0)
    if updated < want or available < want or total > want:
        return False, f"{min(updated, available)}/{want} updated and available" + (
            f", {total - updated} old" if total > updated else "")
    return True, ""


def reconcile_serving(svc: dict[str, Any], observed: dict[tuple[str, str], dict[str, Any]],
                      stats: list[dict[str, Any]], now: dt.datetime,
                      window: HitRateWindow | None = None) -> ServingPlan:
    """``observed`` maps (kind, name) of existing children to their live objects (with status); ``stats``
    holds the rankers' ``/v1/stats`` answers (with ``_target``: the URL polled); ``window`` the earlier
    samples of this service (the caller keeps it between passes; without one there is no baseline and
    ``cacheHitRate`` stays as it was)."""
    meta = svc["metadata"]
    name, namespace, generation = meta["name"], meta["namespace"], meta.get("generation")
    status: dict[str, Any] = json.loads(json.dumps(svc.get("status") or {}))
    status["observedGeneration"] = generation
    plan = ServingPlan(status=status)
    conds = status.get("conditions") or []
    try:
        problem = names.name_problem(name)  # the CRD's CEL rules, for API servers that skipped them
        if problem:
            raise ValueError(problem)
        spec = GRRankingServiceSpec.model_validate(svc.get("spec") or {})
    except (ValidationError, ValueError) as exc:
        message = objects.validation_message(exc)
        ready = objects.condition(conds, "Ready")
        if ready is None or ready.get("reason") != "InvalidSpec":
            plan.events.append(("Warning", "InvalidSpec", message))
        status["conditions"] = objects.set_condition(conds, "Ready", False, "InvalidSpec", message, now, generation)
        return plan

    plan.children = children(svc, spec)
    if not spec.autoscaling and ("HorizontalPodAutoscaler", names.ranker_name(name)) in observed:
        plan.delete.append(("autoscaling/v2", "HorizontalPodAutoscaler", names.ranker_name(name)))
    if not spec.disruption_budget.enabled:
        for child in (names.ranker_name(name), names.router_name(name)):
            if ("PodDisruptionBudget", child) in observed:
                plan.delete.append(("policy/v1", "PodDisruptionBudget", child))
    if not spec.etcd.managed:
        for kind, api in (("StatefulSet", "apps/v1"), ("Service", "v1")):
            if (kind, names.etcd_name(name)) in observed:
                plan.delete.append((api, kind, names.etcd_name(name)))

    desired = {(c["kind"], c["metadata"]["name"]): c for c in plan.children}
    r_key, t_key = ("StatefulSet", names.ranker_name(name)), ("Deployment", names.router_name(name))
    rankers, routers = observed.get(r_key), observed.get(t_key)
    ready_rankers, ready_routers = _ready(rankers), _ready(routers)
    status["replicas"] = int(_status(rankers).get("replicas") or 0)
    status["readyReplicas"] = ready_rankers
    status["updatedReplicas"] = int(_status(rankers).get("updatedReplicas") or 0)
    status["routerReadyReplicas"] = ready_routers
    status["url"] = url(name, namespace, spec)
    status["selector"] = selector_string(name, "ranker")
    if window is not None:
        window.seconds = spec.hit_rate_window_seconds
        known, rate = window.add(now.timestamp(), counters(stats))
        if known and rate is None:
            status.pop("cacheHitRate", None)  # nothing looked up in the window
        elif known:
            status["cacheHitRate"] = rate

    missing, reason = [], ""
    for key, want, label, why in ((r_key, spec.replicas, "rankers", "RankersNotReady"),
                                  (t_key, spec.router.replicas, "routers", "RoutersNotReady")):
        done, message = rollout(desired[key], observed.get(key), want)
        if not done:
            missing.append(f"{label}: {message}")
            reason = reason or why
    if spec.etcd.managed and _ready(observed.get(("StatefulSet", names.etcd_name(name)))) < 1:
        missing.append("etcd not ready")
        reason = reason or "EtcdNotReady"
    if missing:
        status["conditions"] = objects.set_condition(conds, "Ready", False, reason, "; ".join(missing), now,
                                                     generation)
    else:
        was_ready = (objects.condition(conds, "Ready") or {}).get("status") == "True"
        status["conditions"] = objects.set_condition(
            conds, "Ready", True, "AllReplicasReady",
            f"{ready_rankers} rankers and {ready_routers} routers ready at {status['url']}", now, generation)
        if not was_ready:
            plan.events.append(("Normal", "Ready", f"serving at {status['url']}"))
    return plan

