"""A small Kubernetes for operator tests: KMock's API emulator with the API-server behaviour the operator
relies on, a garbage collector, and a local kubelet that runs pod commands as processes.

KMock stores objects and streams watch events but is deliberately simple (see docs/architecture.md §7).
What it lacks and this module adds:

- ``/api/v1/namespaces`` (create, get, list, watch, delete), which KMock cannot route;
- uid, creationTimestamp, resourceVersion and generation on writes (kopf and ownerReferences need them);
  a ``metadata.uid`` in a patch is a precondition (409 on mismatch), as in the real API server;
- for the grstack CRDs: structural pruning, defaulting and validation against the generated
  ``openAPIV3Schema`` (a 422 ``Invalid`` answer naming the field, like the API server's);
- writes to ``status`` through the main resource are ignored (status subresource semantics);
- the garbage collector: objects whose owners are all gone are deleted (ownerReferences);
- the kubelet: a Pod becomes a local process (command/args/env with ``$(VAR)`` expansion and the downward
  API; ConfigMap, emptyDir and PVC volumes mapped to directories, paths in args/env rewritten; the headless
  Service address of rank 0 mapped to 127.0.0.1 and a free port); phases Pending -> Running ->
  Succeeded/Failed with exit codes and termination messages are written back through the API.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime as dt
import itertools
import json
import os
import re
import signal
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import attrs
import jsonschema
import kmock
import yaml

from grstack.operator import crds

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent

CORE = {
    "v1/pods": ("Pod", {"status"}),
    "v1/services": ("Service", {"status"}),
    "v1/configmaps": ("ConfigMap", set()),
    "v1/serviceaccounts": ("ServiceAccount", set()),
    "v1/events": ("Event", set()),
    "v1/persistentvolumeclaims": ("PersistentVolumeClaim", {"status"}),
    "rbac.authorization.k8s.io/v1/roles": ("Role", set()),
    "rbac.authorization.k8s.io/v1/rolebindings": ("RoleBinding", set()),
    "apps/v1/statefulsets": ("StatefulSet", {"status", "scale"}),
    "apps/v1/deployments": ("Deployment", {"status", "scale"}),
    "autoscaling/v2/horizontalpodautoscalers": ("HorizontalPodAutoscaler", {"status"}),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", {"status"}),
}
CLUSTER = {  # cluster-scoped resources kopf looks for during discovery
    "v1/namespaces": "Namespace",
    "apiextensions.k8s.io/v1/customresourcedefinitions": "CustomResourceDefinition",
}
VERBS = {"create", "delete", "get", "list", "patch", "update", "watch"}


# ------------------------------------------------------------------------------------ CRD schema handling


def prune(obj: Any, schema: dict[str, Any]) -> Any:
    """Structural pruning: drop fields the schema does not know (unless it preserves unknown fields)."""
    if isinstance(obj, dict):
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return obj
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        if props is not None:
            return {k: prune(v, props[k]) for k, v in obj.items() if k in props}
        if isinstance(extra, dict):
            return {k: prune(v, extra) for k, v in obj.items()}
        return obj
    if isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [prune(v, schema["items"]) for v in obj]
    return obj


def default(obj: Any, schema: dict[str, Any]) -> Any:
    """Apply ``default`` values the way the API server does (recursively, into defaulted objects too)."""
    if isinstance(obj, dict):
        props = schema.get("properties") or {}
        out = dict(obj)
        for key, sub in props.items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
            if key in out:
                out[key] = default(out[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in out:
                if key not in props:
                    out[key] = default(out[key], extra)
        return out
    if isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [default(v, schema["items"]) for v in obj]
    return obj


def schema_errors(obj: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """Violations of the CRD schema, phrased like the API server (``spec.x: Invalid value: ...``)."""
    validator = jsonschema.Draft4Validator(schema)
    out = []
    for err in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path)):
        where = ".".join(str(p) for p in err.absolute_path) or "<root>"
        out.append(f"{where}: Invalid value: {err.message}")
    for err in _cel_errors(obj, schema, []):
        out.append(err)
    return out


def _cel_errors(obj: Any, schema: dict[str, Any], path: list[str]) -> list[str]:
    """The one CEL rule shape the CRDs use: ``self.a >= self.b`` (the real API server evaluates any rule)."""
    out = []
    if isinstance(obj, dict):
        for rule in schema.get("x-kubernetes-validations", []):
            m = re.fullmatch(r"self\.(\w+) >= self\.(\w+)", rule["rule"])
            if m and m.group(1) in obj and m.group(2) in obj and not obj[m.group(1)] >= obj[m.group(2)]:
                out.append(f"{'.'.join(path)}: Invalid value: {rule['message']}")
        for key, sub in (schema.get("properties") or {}).items():
            if key in obj:
                out += _cel_errors(obj[key], sub, [*path, key])
    return out


def admit_custom_resource(obj: dict[str, Any], schema: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """What the API server stores for a custom resource (pruned, defaulted), and why it would reject it."""
    stored = default(prune(obj, schema), schema)
    stored["metadata"] = obj.get("metadata", {})
    return stored, schema_errors(stored, schema)


# ------------------------------------------------------------------------------------------- API server


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    """KMock's emulator plus the API-server behaviour listed in the module docstring."""

    custom: dict[Any, tuple[str, dict[str, Any]]] = attrs.field(factory=dict)  # resource -> (kind, schema)
    namespaces: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    _versions: Any = attrs.field(factory=lambda: itertools.count(1))

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, (kind, subresources) in CORE.items():
            self.resources[key] = kmock.ResourceInfo(kind=kind, namespaced=True, verbs=VERBS,
                                                     subresources=subresources)
        for key, kind in CLUSTER.items():
            self.resources[key] = kmock.ResourceInfo(kind=kind, namespaced=False, verbs=VERBS)
        for res in crds.RESOURCES:
            key = f"{crds.GROUP}/{crds.VERSION}/{res.plural}"
            subresources = {"status", "scale"} if res.scale else {"status"}
            self.resources[key] = kmock.ResourceInfo(kind=res.kind, namespaced=True, verbs=VERBS,
                                                     subresources=subresources, singular=res.singular)
            schema = crds.crd(res)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
            self.custom[kmock.resource(key)] = (res.kind, schema)

    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # KMock cannot parse /api/v1/namespaces[/name] (it reads "namespaces" as the namespace prefix).
        match = re.fullmatch(r"/api/v1/namespaces(?:/([^/]+))?/?", raw.path)
        if match is None:
            return await super().__call__(raw)
        return await self._namespace(raw, match.group(1))

    async def _namespace(self, raw: aiohttp.web.BaseRequest, name: str | None) -> aiohttp.web.StreamResponse:
        web = aiohttp.web
        self.namespaces.setdefault("default", self._namespace_object("default"))
        if raw.method == "POST":
            obj = self._namespace_object((await raw.json())["metadata"]["name"])
            if obj["metadata"]["name"] in self.namespaces:
                return web.json_response({"kind": "Status", "code": 409, "reason": "AlreadyExists"}, status=409)
            self.namespaces[obj["metadata"]["name"]] = obj
            return web.json_response(obj, status=201)
        if name is not None:
            obj = self.namespaces.pop(name, None) if raw.method == "DELETE" else self.namespaces.get(name)
            if obj is None:
                return web.json_response({"kind": "Status", "code": 404, "reason": "NotFound"}, status=404)
            return web.json_response(obj)
        if raw.query.get("watch") == "true":  # the current namespaces, then silence until the client leaves
            response = web.StreamResponse()
            await response.prepare(raw)
            for obj in list(self.namespaces.values()):
                await response.write(json.dumps({"type": "ADDED", "object": obj}).encode() + b"\n")
            await asyncio.sleep(float(raw.query.get("timeoutSeconds", 3600)))
            return response
        return web.json_response({"kind": "NamespaceList", "apiVersion": "v1",
                                  "metadata": {"resourceVersion": str(next(self._versions))},
                                  "items": list(self.namespaces.values())})

    def _namespace_object(self, name: str) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": name, "uid": str(uuid.uuid4()), "creationTimestamp": _now(),
                             "resourceVersion": str(next(self._versions))}, "status": {"phase": "Active"}}

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource is not None and isinstance(request.data, dict):
            if request.action == kmock.action.CREATE:
                self._admit_create(request)
            elif request.action == kmock.action.UPDATE:
                self._admit_update(request)
        return await super()._handle(request)

    def _admit_create(self, request: kmock.Request) -> None:
        data = request.data
        meta = data.setdefault("metadata", {})
        if request.namespace and not meta.get("namespace"):
            meta["namespace"] = request.namespace
        custom = self.custom.get(request.resource)
        if custom is not None:
            kind, schema = custom
            stored, errors = admit_custom_resource(data, schema)
            if errors:
                raise kmock.KubernetesError(
                    status=422, reason="Invalid",
                    message=f'{kind}.{crds.GROUP} "{meta.get("name")}" is invalid: ' + "; ".join(errors),
                    details={"name": meta.get("name"), "kind": kind, "causes": errors})
            stored.pop("status", None)
            data.clear()
            data.update(stored)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), resourceVersion=str(next(self._versions)),
                     generation=1)

    def _admit_update(self, request: kmock.Request) -> None:
        data = request.data
        key = (request.resource, request.namespace, request.name)
        current = self.objects[key].raw if key in self.objects and not self.objects[key].deleted else None
        meta = data.get("metadata") or {}
        if current is not None:
            expected = meta.get("uid")
            if expected and expected != current["metadata"].get("uid"):
                raise kmock.KubernetesError(status=409, reason="Conflict",
                                            message=f"Precondition failed: UID in precondition: {expected}, "
                                                    f"UID in object meta: {current['metadata'].get('uid')}")
            if request.resource in self.custom and request.subresource is None:
                data.pop("status", None)  # the status subresource owns status
            if request.subresource is None and "spec" in data:
                meta["generation"] = int(current["metadata"].get("generation") or 1) + 1
        data["metadata"] = meta
        meta["resourceVersion"] = str(next(self._versions))

    def live(self, plural_key: str) -> list[dict[str, Any]]:
        """Current objects of one resource (e.g. ``v1/pods``), as plain dicts."""
        res = kmock.resource(plural_key)
        return [copy.deepcopy(obj.raw) for (r, _, _), obj in list(self.objects.items())
                if r == res and not obj.deleted]


def object_path(res: Any, namespace: str | None, name: str | None = None, sub: str | None = None) -> str:
    prefix = "/api/v1" if res.group == "" else f"/apis/{res.group}/{res.version}"
    out = prefix + (f"/namespaces/{namespace}" if namespace else "") + f"/{res.plural}"
    return out + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")


async def collect_garbage(server: ApiServer, http: aiohttp.ClientSession, period: float = 0.2) -> None:
    """Deletes dependents whose owners are all gone, like kube-controller-manager's garbage collector."""
    while True:
        await asyncio.sleep(period)
        items = [(k, o.raw) for k, o in list(server.objects.items()) if not o.deleted]
        uids = {raw.get("metadata", {}).get("uid") for _, raw in items}
        for (res, ns, name), raw in items:
            refs = raw.get("metadata", {}).get("ownerReferences") or []
            if refs and not any(ref.get("uid") in uids for ref in refs):
                async with http.delete(object_path(res, ns, name)) as resp:
                    await resp.read()


# ---------------------------------------------------------------------------------------------- kubelet


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@attrs.define
class _Container:
    uid: str
    namespace: str
    name: str
    process: asyncio.subprocess.Process | None = None
    log: Path | None = None
    deleted: bool = False


class LocalKubelet:
    """Runs every Pod in the emulator as a local process and reports its phase back (see module docstring)."""

    def __init__(self, server: ApiServer, http: aiohttp.ClientSession, api_url: str, root: Path,
                 command_map: dict[str, list[str]] | None = None, period: float = 0.1) -> None:
        self.server = server
        self.http = http
        self.api_url = api_url
        self.root = root
        self.command_map = {"grstack": [str(VENV_BIN / "grstack")], **(command_map or {})}
        self.period = period
        self.enabled = True  # False: pods stay Pending (nothing is run)
        self.containers: dict[str, _Container] = {}
        self.ports: dict[tuple[str, str, str], int] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        try:
            while True:
                self._sync()
                await asyncio.sleep(self.period)
        finally:
            for c in self.containers.values():
                self._signal(c, signal.SIGKILL)
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _sync(self) -> None:
        pods = {p["metadata"]["uid"]: p for p in self.server.live("v1/pods")}
        for uid, c in self.containers.items():
            gone = uid not in pods or bool(pods[uid]["metadata"].get("deletionTimestamp"))
            if gone and not c.deleted:
                c.deleted = True
                self._signal(c, signal.SIGTERM)
                task = asyncio.create_task(self._reap(c))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        for uid, pod in pods.items():
            if self.enabled and uid not in self.containers and not pod["metadata"].get("deletionTimestamp"):
                c = _Container(uid=uid, namespace=pod["metadata"]["namespace"], name=pod["metadata"]["name"])
                self.containers[uid] = c
                task = asyncio.create_task(self._run_pod(c, pod))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    def pod(self, name: str, namespace: str = "default") -> _Container:
        live = [c for c in self.containers.values() if c.name == name and c.namespace == namespace
                and not c.deleted]
        if not live:
            raise KeyError(f"no running pod {namespace}/{name}")
        return live[-1]

    def kill(self, name: str, namespace: str = "default") -> None:
        """SIGKILL the pod's process (a crashed worker: the pod goes Failed with exit status 137)."""
        self._signal(self.pod(name, namespace), signal.SIGKILL)

    def logs(self, name: str, namespace: str = "default") -> str:
        cs = [c for c in self.containers.values() if c.name == name and c.namespace == namespace and c.log]
        return "\n".join(c.log.read_text(errors="replace") for c in cs if c.log.exists())

    @staticmethod
    def _signal(c: _Container, sig: int) -> None:
        if c.process is not None and c.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(c.process.pid, sig)

    async def _reap(self, c: _Container) -> None:
        if c.process is None:
            return
        try:
            await asyncio.wait_for(c.process.wait(), timeout=5)
        except TimeoutError:
            self._signal(c, signal.SIGKILL)
            await c.process.wait()

    async def _patch_status(self, c: _Container, status: dict[str, Any]) -> None:
        body = {"metadata": {"uid": c.uid}, "status": status}
        url = f"/api/v1/namespaces/{c.namespace}/pods/{c.name}/status"
        async with self.http.patch(url, json=body, headers={"Content-Type": "application/merge-patch+json"}) as r:
            await r.read()  # 404/409: the pod is gone or was replaced; nothing to report

    async def _run_pod(self, c: _Container, pod: dict[str, Any]) -> None:
        pod_dir = self.root / "pods" / c.uid
        container = pod["spec"]["containers"][0]
        while True:  # ContainerCreating: wait for the ConfigMaps the volumes need
            if c.deleted:
                return
            mounts = self._volumes(pod, container, pod_dir)
            if mounts is not None:
                break
            await asyncio.sleep(self.period)
        env = self._env(pod, container, mounts)
        argv = [self._rewrite(_expand(a, env), mounts) for a in container.get("command", [])]
        argv += [self._rewrite(_expand(a, env), mounts) for a in container.get("args", [])]
        argv = self.command_map.get(argv[0], [argv[0]]) + argv[1:]
        c.log = pod_dir / "container.log"
        c.log.parent.mkdir(parents=True, exist_ok=True)
        with c.log.open("wb") as out:
            c.process = await asyncio.create_subprocess_exec(
                *argv, env=env, cwd=pod_dir, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out,
                start_new_session=True)
        started = _now()
        await self._patch_status(c, {
            "phase": "Running", "podIP": "127.0.0.1", "hostIP": "127.0.0.1", "startTime": started,
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": started}],
            "containerStatuses": [{"name": container["name"], "ready": True, "restartCount": 0,
                                   "image": container.get("image", ""), "imageID": "",
                                   "state": {"running": {"startedAt": started}}}]})
        code = await c.process.wait()
        if c.deleted:
            return
        exit_code = code if code >= 0 else 128 - code
        tail = c.log.read_bytes()[-2048:].decode(errors="replace") if exit_code else ""
        await self._patch_status(c, {
            "phase": "Succeeded" if exit_code == 0 else "Failed",
            "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": _now()}],
            "containerStatuses": [{"name": container["name"], "ready": False, "restartCount": 0,
                                   "image": container.get("image", ""), "imageID": "",
                                   "state": {"terminated": {
                                       "exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                                       "message": tail, "startedAt": started, "finishedAt": _now()}}}]})

    def _volumes(self, pod: dict[str, Any], container: dict[str, Any], pod_dir: Path) -> list[tuple[str, str]] | None:
        """(mountPath, local dir) pairs, longest mount path first; None while a ConfigMap is missing."""
        ns = pod["metadata"]["namespace"]
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        out = []
        for m in container.get("volumeMounts", []):
            vol = volumes[m["name"]]
            if "persistentVolumeClaim" in vol:
                local = self.root / "pvc" / ns / vol["persistentVolumeClaim"]["claimName"]
            else:
                local = pod_dir / "volumes" / m["name"]
            local.mkdir(parents=True, exist_ok=True)
            if "configMap" in vol:
                cms = [o for o in self.server.live("v1/configmaps")
                       if o["metadata"]["namespace"] == ns and o["metadata"]["name"] == vol["configMap"]["name"]]
                if not cms:
                    return None
                for key, text in (cms[0].get("data") or {}).items():
                    (local / key).write_text(text)
            out.append((m["mountPath"].rstrip("/"), str(local)))
        return sorted(out, key=lambda pair: -len(pair[0]))

    def _env(self, pod: dict[str, Any], container: dict[str, Any], mounts: list[tuple[str, str]]) -> dict[str, str]:
        meta = pod["metadata"]
        env = {"PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
               "GRSTACK_KUBE_API": self.api_url}
        fields = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
                  "metadata.uid": meta["uid"], "status.podIP": "127.0.0.1", "spec.nodeName": "local"}
        subdomain = pod["spec"].get("subdomain")
        for item in container.get("env", []):
            if "value" in item:
                value = _expand(item["value"], env)
            else:
                value = fields.get(item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath"), "")
            env[item["name"]] = self._rewrite(value, mounts)
        if subdomain and env.get("MASTER_ADDR", "").endswith(f".{subdomain}"):
            env["MASTER_ADDR"] = "127.0.0.1"
            # One port per gang incarnation: a dying pod of the previous attempt must not hold the new one's
            # rendezvous port (in a cluster each pod has its own IP).
            key = (meta["namespace"], subdomain, meta.get("labels", {}).get("grstack.io/attempt", ""))
            env["MASTER_PORT"] = str(self.ports.setdefault(key, free_port()))
        return env

    @staticmethod
    def _rewrite(value: str, mounts: list[tuple[str, str]]) -> str:
        prefix, _, path = value.rpartition("=") if value.startswith("--") else ("", "", value)
        for mount, local in mounts:
            if path == mount or path.startswith(mount + "/"):
                path = local + path[len(mount):]
                break
        return f"{prefix}={path}" if prefix else path


def _expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)


# ----------------------------------------------------------------------------------------------- cluster


class OperatorProcess:
    def __init__(self, proc: asyncio.subprocess.Process, log: Path, liveness: str, metrics: str) -> None:
        self.proc = proc
        self.log = log
        self.liveness = liveness
        self.metrics_url = metrics

    async def get(self, url: str) -> tuple[int, str]:
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            return resp.status, await resp.text()

    async def wait_live(self, timeout: float = 120) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if self.proc.returncode is not None:
                raise RuntimeError(f"operator exited with {self.proc.returncode}:\n{self.log.read_text()}")
            with contextlib.suppress(aiohttp.ClientError):
                if (await self.get(self.liveness))[0] == 200:
                    return
            await asyncio.sleep(0.2)
        raise AssertionError(f"operator not live:\n{self.log.read_text()}")

    async def metrics(self) -> str:
        return (await self.get(self.metrics_url))[1]

    async def stop(self) -> None:
        if self.proc.returncode is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout=30)
            except TimeoutError:
                os.killpg(self.proc.pid, signal.SIGKILL)
                await self.proc.wait()


class Cluster:
    """The emulated API server + garbage collector + kubelet (+ the operator, when started)."""

    def __init__(self, server: ApiServer, url: str, http: aiohttp.ClientSession, kubelet: LocalKubelet,
                 root: Path) -> None:
        self.server = server
        self.url = url
        self.http = http
        self.kubelet = kubelet
        self.root = root
        self.op: OperatorProcess | None = None

    @classmethod
    @contextlib.asynccontextmanager
    async def start(cls, root: Path, command_map: dict[str, list[str]] | None = None) -> AsyncIterator[Cluster]:
        async with ApiServer() as server, kmock.Server(server) as srv:
            url = str(srv.url).rstrip("/")
            async with aiohttp.ClientSession(url) as http:
                kubelet = LocalKubelet(server, http, url, root, command_map)
                tasks = [asyncio.create_task(kubelet.run()), asyncio.create_task(collect_garbage(server, http))]
                try:
                    yield cls(server, url, http, kubelet, root)
                finally:
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)

    @contextlib.asynccontextmanager
    async def operator(self, resync_seconds: float = 1.0) -> AsyncIterator[OperatorProcess]:
        """``grstack operator`` as a process logged in to the emulator (kopf owns its event loop: it cancels
        every task it did not start, so it cannot share the test's loop)."""
        liveness, metrics = free_port(), free_port()
        log = self.root / "operator.log"
        with log.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                str(VENV_BIN / "grstack"), "operator", "--server", self.url, "--resync-seconds", str(resync_seconds),
                "--liveness-port", str(liveness), "--metrics-port", str(metrics), "--all-namespaces",
                stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
        op = OperatorProcess(proc, log, f"http://127.0.0.1:{liveness}/healthz", f"http://127.0.0.1:{metrics}/metrics")
        try:
            await op.wait_live()
            self.op = op
            yield op
        finally:
            await op.stop()

    # -- client helpers ---------------------------------------------------------------------------------
    async def request(self, method: str, path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
        headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
        async with self.http.request(method, path, json=body, headers=headers) as resp:
            text = await resp.text()
            return resp.status, (yaml.safe_load(text) if text else {})

    async def apply(self, obj: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        res = kmock.resource(_plural_key(obj))
        ns = obj["metadata"].setdefault("namespace", "default")
        return await self.request("POST", object_path(res, ns), obj)

    async def patch(self, plural_key: str, name: str, body: dict[str, Any], sub: str | None = None,
                    namespace: str = "default") -> tuple[int, dict[str, Any]]:
        return await self.request("PATCH", object_path(kmock.resource(plural_key), namespace, name, sub), body)

    async def delete(self, plural_key: str, name: str, namespace: str = "default") -> tuple[int, dict[str, Any]]:
        return await self.request("DELETE", object_path(kmock.resource(plural_key), namespace, name))

    def get(self, plural_key: str, name: str, namespace: str = "default") -> dict[str, Any] | None:
        for obj in self.server.live(plural_key):
            if obj["metadata"]["name"] == name and obj["metadata"].get("namespace") == namespace:
                return obj
        return None

    def states(self, plural_key: str, name: str, namespace: str = "default") -> list[str]:
        """The distinct ``status.state`` values an object went through, in order (from KMock's history)."""
        key = (kmock.resource(plural_key), namespace, name)
        out: list[str] = []
        for version in self.server.objects[key].history:
            state = ((version.raw if version is not None else {}).get("status") or {}).get("state")
            if state and (not out or out[-1] != state):
                out.append(state)
        return out

    def pods(self, label: str, value: str) -> list[dict[str, Any]]:
        return [p for p in self.server.live("v1/pods") if p["metadata"].get("labels", {}).get(label) == value]

    async def wait_for(self, what: str, predicate: Callable[[], Any], timeout: float = 60) -> Any:
        """Polls until ``predicate()`` is truthy; fails naming ``what`` (no timing is asserted)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if loop.time() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            await asyncio.sleep(0.1)


def _plural_key(obj: dict[str, Any]) -> str:
    api = obj["apiVersion"]
    for key, (kind, _) in CORE.items():
        if kind == obj["kind"] and key.startswith(api + "/"):
            return key
    for res in crds.RESOURCES:
        if res.kind == obj["kind"]:
            return f"{crds.GROUP}/{crds.VERSION}/{res.plural}"
    raise KeyError(obj["kind"])


async def _serve(kubeconfig: Path) -> None:
    """An emulated cluster for trying things by hand or dry-running the ``cluster`` suite against it."""
    import tempfile

    async with Cluster.start(Path(tempfile.mkdtemp(prefix="grstack-kmock-"))) as c:
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": c.url}}],
            "users": [{"name": "kmock", "user": {"token": "kmock"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}]}))
        print(f"emulated cluster at {c.url}; KUBECONFIG={kubeconfig}; pods run here under {c.root}", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=_serve.__doc__)
    parser.add_argument("--kubeconfig", type=Path, default=Path("kmock.kubeconfig"))
    asyncio.run(_serve(parser.parse_args().kubeconfig))
