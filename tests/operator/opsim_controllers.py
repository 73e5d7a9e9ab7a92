"""Minimal but real StatefulSet, Deployment and HorizontalPodAutoscaler controllers for the emulator
(opsim.py), and the pod network the local kubelet needs to run serving pods behind Services.

The controllers act through the API, as kube-controller-manager does (so every pod they create is admitted,
defaulted and validated like any other): a StatefulSet makes pods ``NAME-0..N-1`` from its template (hostname
and subdomain, ownerReferences, revision labels, PVCs from volumeClaimTemplates), in order for
``OrderedReady``, replacing pods that ended and rolling a changed template from the highest ordinal; a
Deployment makes ``NAME-HASH-XXXXX`` pods owned by the Deployment itself (no ReplicaSet object) and rolls a
changed template with surge; both report replicas, readyReplicas, updatedReplicas, availableReplicas and
observedGeneration from their pods. The HPA controller reads a metric the test sets (``metrics``) and moves
its target's ``/scale`` between minReplicas and maxReplicas.

What is not modelled: scheduling, ReplicaSet objects and revision history, minReadySeconds, PVC deletion
policies, the HPA's stabilisation windows and behaviour policies, metrics from a metrics server.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import math
import secrets
import socket
from typing import Any

import aiohttp
import opsim_builtin

ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
MERGE = {"Content-Type": "application/merge-patch+json"}


def ready(pod: dict[str, Any]) -> bool:
    """The pod's Ready condition is True and it is not being deleted."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def ended(pod: dict[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def _owned(pods: list[dict[str, Any]], uid: str) -> list[dict[str, Any]]:
    return [p for p in pods if any(r.get("uid") == uid and r.get("controller")
                                   for r in p["metadata"].get("ownerReferences") or [])]


def _owner(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj["metadata"]
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def _int_or_percent(value: Any, total: int, round_up: bool) -> int:
    if isinstance(value, str) and value.endswith("%"):
        share = total * int(value[:-1]) / 100
        return math.ceil(share) if round_up else math.floor(share)
    return int(value or 0)


class Controllers:
    """The three controllers, one reconcile pass over all objects every ``period`` seconds."""

    def __init__(self, server: Any, http: aiohttp.ClientSession, period: float = 0.2) -> None:
        self.server = server
        self.http = http
        self.period = period
        self.enabled = True
        self.metrics: dict[tuple[str, str], float] = {}  # (namespace, HPA name) -> the metric's current value
        self.errors: list[str] = []  # refusals the controllers met (also written as Warning Events)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            if not self.enabled:
                continue
            pods = self.server.live("v1/pods")
            for sts in self.server.live("apps/v1/statefulsets"):
                if not sts["metadata"].get("deletionTimestamp"):
                    await self._statefulset(sts, pods)
            for dep in self.server.live("apps/v1/deployments"):
                if not dep["metadata"].get("deletionTimestamp"):
                    await self._deployment(dep, pods)
            for hpa in self.server.live("autoscaling/v2/horizontalpodautoscalers"):
                await self._hpa(hpa)

    # -- API calls ------------------------------------------------------------------------------------
    async def _call(self, method: str, path: str, body: Any = None, *,
                    owner: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        headers = MERGE if method == "PATCH" else {}
        async with self.http.request(method, path, json=body, headers=headers) as resp:
            text = await resp.text()
            payload = json.loads(text) if text.startswith("{") else {}
        if resp.status >= 400 and resp.status not in (404, 409) and owner is not None:
            message = str(payload.get("message") or text)
            self.errors.append(message)
            await self._event(owner, "FailedCreate" if method == "POST" else "FailedUpdate", message)
        return resp.status, payload

    async def _event(self, obj: dict[str, Any], reason: str, message: str) -> None:
        meta = obj["metadata"]
        event = {"apiVersion": "v1", "kind": "Event",
                 "metadata": {"name": f"{meta['name']}.{secrets.token_hex(8)}", "namespace": meta["namespace"]},
                 "involvedObject": {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": meta["name"],
                                    "namespace": meta["namespace"], "uid": meta["uid"]},
                 "reason": reason, "message": message, "type": "Warning", "count": 1,
                 "source": {"component": f"{obj['kind'].lower()}-controller"}}
        async with self.http.post(f"/api/v1/namespaces/{meta['namespace']}/events", json=event) as resp:
            await resp.read()

    async def _delete_pod(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        if not meta.get("deletionTimestamp"):
            await self._call("DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}")

    async def _set_status(self, obj: dict[str, Any], plural: str, status: dict[str, Any]) -> None:
        current = obj.get("status") or {}
        if all(current.get(k) == v for k, v in status.items()):
            return
        meta = obj["metadata"]
        prefix = "/api/v1" if obj["apiVersion"] == "v1" else f"/apis/{obj['apiVersion']}"
        await self._call("PATCH", f"{prefix}/namespaces/{meta['namespace']}/{plural}/{meta['name']}/status",
                         {"metadata": {"uid": meta["uid"]}, "status": status})

    def _pod(self, owner: dict[str, Any], name: str, extra_labels: dict[str, str]) -> dict[str, Any]:
        template = copy.deepcopy(owner["spec"]["template"])
        tmeta = template.get("metadata") or {}
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": owner["metadata"]["namespace"],
                             "labels": {**(tmeta.get("labels") or {}), **extra_labels},
                             "annotations": dict(tmeta.get("annotations") or {}),
                             "ownerReferences": [_owner(owner)]},
                "spec": template.get("spec") or {}}

    # -- StatefulSet ----------------------------------------------------------------------------------
    async def _statefulset(self, sts: dict[str, Any], all_pods: list[dict[str, Any]]) -> None:
        meta, spec = sts["metadata"], sts["spec"]
        name = meta["name"]
        want = int(spec.get("replicas", 1))
        revision = f"{name}-{opsim_builtin.template_hash(spec.get('template') or {})}"
        pods = {p["metadata"]["name"]: p for p in _owned(all_pods, meta["uid"])}
        by_ordinal = {int(n.rpartition("-")[2]): p for n, p in pods.items() if n.rpartition("-")[2].isdigit()}
        ordered = spec.get("podManagementPolicy", "OrderedReady") == "OrderedReady"
        for pod in pods.values():  # restartPolicy Always: a pod that ended is replaced (same name)
            if ended(pod):
                await self._delete_pod(pod)
        for i in range(want):
            member = by_ordinal.get(i)
            if member is None:
                await self._create_sts_pod(sts, i, revision)
                if ordered:
                    break
            elif ordered and not ready(member):
                break
        surplus = sorted((i for i in by_ordinal if i >= want), reverse=True)
        for i in surplus[:1] if ordered else surplus:
            await self._delete_pod(by_ordinal[i])
        strategy = spec.get("updateStrategy") or {}
        partition = int((strategy.get("rollingUpdate") or {}).get("partition") or 0)
        live = [by_ordinal.get(i) for i in range(want)]
        if strategy.get("type", "RollingUpdate") == "RollingUpdate" and all(p is not None and ready(p) for p in live):
            stale = [i for i in range(want - 1, partition - 1, -1)
                     if (by_ordinal[i]["metadata"].get("labels") or {}).get("controller-revision-hash") != revision]
            if stale:
                await self._delete_pod(by_ordinal[stale[0]])
        current = [p for p in pods.values() if not p["metadata"].get("deletionTimestamp")]
        updated = [p for p in current if (p["metadata"].get("labels") or {}).get("controller-revision-hash")
                   == revision]
        n_ready = sum(1 for p in current if ready(p))
        old_revision = (sts.get("status") or {}).get("currentRevision") or revision
        await self._set_status(sts, "statefulsets", {
            "observedGeneration": meta.get("generation", 1), "replicas": len(current), "readyReplicas": n_ready,
            "currentReplicas": len(updated) if len(updated) == len(current) else len(current) - len(updated),
            "updatedReplicas": len(updated), "availableReplicas": n_ready,
            "currentRevision": revision if len(updated) == len(current) == want else old_revision,
            "updateRevision": revision, "collisionCount": 0})

    async def _create_sts_pod(self, sts: dict[str, Any], ordinal: int, revision: str) -> None:
        meta, spec = sts["metadata"], sts["spec"]
        pod_name = f"{meta['name']}-{ordinal}"
        pod = self._pod(sts, pod_name, {"controller-revision-hash": revision,
                                        "statefulset.kubernetes.io/pod-name": pod_name,
                                        "apps.kubernetes.io/pod-index": str(ordinal)})
        pod["spec"]["hostname"] = pod_name
        if spec.get("serviceName"):
            pod["spec"]["subdomain"] = spec["serviceName"]
        volumes = pod["spec"].setdefault("volumes", [])
        for claim in spec.get("volumeClaimTemplates") or []:
            claim_name = f"{claim['metadata']['name']}-{pod_name}"
            pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                   "metadata": {"name": claim_name, "namespace": meta["namespace"],
                                "labels": dict((spec.get("selector") or {}).get("matchLabels") or {})},
                   "spec": copy.deepcopy(claim.get("spec") or {})}
            await self._call("POST", f"/api/v1/namespaces/{meta['namespace']}/persistentvolumeclaims", pvc, owner=sts)
            if not any(v.get("name") == claim["metadata"]["name"] for v in volumes):
                volumes.append({"name": claim["metadata"]["name"], "persistentVolumeClaim": {"claimName": claim_name}})
        if not volumes:
            pod["spec"].pop("volumes")
        await self._call("POST", f"/api/v1/namespaces/{meta['namespace']}/pods", pod, owner=sts)

    # -- Deployment -----------------------------------------------------------------------------------
    async def _deployment(self, dep: dict[str, Any], all_pods: list[dict[str, Any]]) -> None:
        meta, spec = dep["metadata"], dep["spec"]
        want = int(spec.get("replicas", 1))
        pod_hash = opsim_builtin.template_hash(spec.get("template") or {})
        owned = [p for p in _owned(all_pods, meta["uid"]) if not p["metadata"].get("deletionTimestamp")]
        for pod in [p for p in owned if ended(p)]:
            await self._delete_pod(pod)
            owned.remove(pod)
        new = [p for p in owned if (p["metadata"].get("labels") or {}).get("pod-template-hash") == pod_hash]
        old = [p for p in owned if p not in new]
        strategy = spec.get("strategy") or {}
        if strategy.get("type") == "Recreate":
            for pod in old:
                await self._delete_pod(pod)
            creatable = 0 if old else want - len(new)
        else:
            rolling = strategy.get("rollingUpdate") or {}
            unavailable = _int_or_percent(rolling.get("maxUnavailable", "25%"), want, round_up=False)
            surge = max(_int_or_percent(rolling.get("maxSurge", "25%"), want, round_up=True),
                        0 if unavailable else 1)
            creatable = min(want - len(new), want + surge - len(owned))
            ready_new, ready_old = sum(map(ready, new)), sum(map(ready, old))
            for pod in sorted(old, key=ready):  # not-ready old pods first; ready ones while enough stay up
                if ready(pod):
                    if ready_new + ready_old - 1 < want - unavailable:
                        break
                    ready_old -= 1
                await self._delete_pod(pod)
        for _ in range(max(0, creatable)):
            suffix = "".join(secrets.choice(ALPHABET) for _ in range(5))
            pod = self._pod(dep, f"{meta['name']}-{pod_hash}-{suffix}", {"pod-template-hash": pod_hash})
            await self._call("POST", f"/api/v1/namespaces/{meta['namespace']}/pods", pod, owner=dep)
        for pod in sorted(new, key=ready)[:max(0, len(new) - want)]:
            await self._delete_pod(pod)
        n_ready = sum(map(ready, owned))
        n_new_ready = sum(map(ready, new))
        min_available = want - _int_or_percent((strategy.get("rollingUpdate") or {}).get("maxUnavailable", "25%"),
                                               want, round_up=False)
        complete = len(new) == want and not old and n_new_ready == want
        await self._set_status(dep, "deployments", {
            "observedGeneration": meta.get("generation", 1), "replicas": len(owned), "updatedReplicas": len(new),
            "readyReplicas": n_ready, "availableReplicas": n_ready,
            "unavailableReplicas": max(0, want - n_ready),
            "conditions": [
                {"type": "Available", "status": "True" if n_ready >= min_available else "False",
                 "reason": "MinimumReplicasAvailable" if n_ready >= min_available else "MinimumReplicasUnavailable"},
                {"type": "Progressing", "status": "True",
                 "reason": "NewReplicaSetAvailable" if complete else "ReplicaSetUpdated"}]})

    # -- HorizontalPodAutoscaler ----------------------------------------------------------------------
    def _scale_path(self, namespace: str, ref: dict[str, Any]) -> str | None:
        group, _, version = str(ref.get("apiVersion", "")).rpartition("/")
        for res, info in self.server.resources.items():
            if info.kind == ref.get("kind") and res.group == group and res.version == version and res.plural:
                prefix = "/api/v1" if not group else f"/apis/{group}/{version}"
                return f"{prefix}/namespaces/{namespace}/{res.plural}/{ref.get('name')}/scale"
        return None

    async def _hpa(self, hpa: dict[str, Any]) -> None:
        meta, spec = hpa["metadata"], hpa.get("spec") or {}
        value = self.metrics.get((meta["namespace"], meta["name"]))
        path = self._scale_path(meta["namespace"], spec.get("scaleTargetRef") or {})
        metric: dict[str, Any] = next(iter(spec.get("metrics") or []), {})
        target = ((metric.get(metric.get("type", "").lower().replace("containerresource", "containerResource"))
                   or {}).get("target") or {})
        goal = target.get("averageUtilization") or target.get("averageValue") or target.get("value")
        if value is None or path is None or goal is None:
            return
        code, scale = await self._call("GET", path)
        if code != 200:
            return
        current = int((scale.get("spec") or {}).get("replicas") or 0)
        if current == 0:  # scaled to zero by hand: the HPA leaves it alone
            return
        ratio = value / float(opsim_builtin.parse(goal)[0])
        desired = current if abs(ratio - 1) <= 0.1 else math.ceil(current * ratio)
        low, high = int(spec.get("minReplicas") or 1), int(spec.get("maxReplicas") or current)
        desired = min(max(desired, low), high)
        status: dict[str, Any] = {"currentReplicas": current, "desiredReplicas": desired,
                                  "currentMetrics": [{"type": metric.get("type"), "value": value}]}
        if desired != current:
            code, _ = await self._call("PATCH", path, {"spec": {"replicas": desired}}, owner=hpa)
            if code < 300:
                status["lastScaleTime"] = _now()
        await self._set_status(hpa, "horizontalpodautoscalers", status)


def _now() -> str:
    import datetime as dt

    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# -------------------------------------------------------------------------------------------- networking


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PodNetwork:
    """Pods on one host: each container port of a pod gets a local port (``--port N`` in its args is
    rewritten), and ``SERVICE[.NS[.svc[.cluster.local]]]:PORT`` in args resolves to 127.0.0.1 and the local
    port of a ready endpoint pod (the Service's selector and targetPort), as cluster DNS and kube-proxy
    would; a pod whose args name a Service without a ready endpoint waits, like one waiting for a volume."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.ports: dict[tuple[str, int], int] = {}  # (pod uid, containerPort) -> local port

    def local_port(self, pod: dict[str, Any], container_port: int) -> int:
        return self.ports.setdefault((pod["metadata"]["uid"], container_port), free_port())

    def _container_port(self, pod: dict[str, Any], target: Any) -> int | None:
        for c in pod["spec"].get("containers") or []:
            for p in c.get("ports") or []:
                if target in (p.get("containerPort"), p.get("name")):
                    return int(p["containerPort"])
        return target if isinstance(target, int) else None

    def service_endpoint(self, namespace: str, service: str, port: int) -> int | None:
        """The local port behind ``service:port`` (a ready endpoint pod's), None while there is none."""
        svc = next((s for s in self.server.live("v1/services") if s["metadata"]["name"] == service
                    and s["metadata"]["namespace"] == namespace), None)
        if svc is None:
            return None
        spec = svc.get("spec") or {}
        sport = next((p for p in spec.get("ports") or [] if p.get("port") == port), None)
        selector = spec.get("selector") or {}
        if sport is None or not selector:
            return None
        for pod in self.server.live("v1/pods"):
            labels = pod["metadata"].get("labels") or {}
            if pod["metadata"]["namespace"] == namespace and ready(pod) and \
                    all(labels.get(k) == v for k, v in selector.items()):
                cport = self._container_port(pod, sport.get("targetPort", port))
                if cport is not None and (pod["metadata"]["uid"], cport) in self.ports:
                    return self.ports[(pod["metadata"]["uid"], cport)]
        return None

    def rewrite_args(self, pod: dict[str, Any], argv: list[str]) -> list[str] | None:
        """argv with ports and Service addresses made local; None while a named Service has no endpoint."""
        ns = pod["metadata"]["namespace"]
        declared = {int(p["containerPort"]) for c in pod["spec"].get("containers") or []
                    for p in c.get("ports") or [] if "containerPort" in p}
        services = {s["metadata"]["name"] for s in self.server.live("v1/services")  # those with endpoints to wait for
                    if s["metadata"]["namespace"] == ns and (s.get("spec") or {}).get("selector")}
        out = []
        for i, arg in enumerate(argv):
            if i and argv[i - 1] == "--port" and arg.isdigit() and int(arg) in declared:
                arg = str(self.local_port(pod, int(arg)))
            else:
                prefix, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
                host, colon, port = value.rpartition(":")
                name = host.split(".")[0] if host else ""
                suffix = host[len(name):]
                if colon and port.isdigit() and name in services and suffix in ("", f".{ns}", f".{ns}.svc",
                                                                                  f".{ns}.svc.cluster.local"):
                    local = self.service_endpoint(ns, name, int(port))
                    if local is None:
                        return None
                    value = f"127.0.0.1:{local}"
                    arg = f"{prefix}{eq}{value}" if eq else value
            out.append(arg)
        return out

    async def probe(self, pod: dict[str, Any], container: dict[str, Any]) -> bool:
        """The container's readinessProbe (httpGet) against its local port; True without a probe."""
        http = (container.get("readinessProbe") or {}).get("httpGet")
        if not http:
            return True
        cport = self._container_port(pod, http.get("port"))
        if cport is None:
            return False
        scheme = str(http.get("scheme", "HTTP")).lower()
        url = f"{scheme}://127.0.0.1:{self.local_port(pod, cport)}{http.get('path', '/')}"
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
            async with aiohttp.ClientSession() as http_client, http_client.get(
                    url, ssl=False, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                return 200 <= resp.status < 400
        return False
