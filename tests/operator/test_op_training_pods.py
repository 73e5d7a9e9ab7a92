"""Issue #13 item 3: the worker pod-template overlay and nprocPerNode (several ranks per pod)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from grstack.operator import names
from grstack.operator.training import parse_spec, reconcile_training

pytestmark = pytest.mark.unit

NOW = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)


def job(workers: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {"apiVersion": names.API_VERSION, "kind": names.TRAINING_KIND,
            "metadata": {"name": "demo", "namespace": "ns", "uid": "uid-1", "generation": 1},
            "spec": {"image": "grstack:cpu", "workers": workers, **spec}, "status": {}}


def pods(workers: dict[str, Any], **spec: Any) -> dict[str, dict[str, Any]]:
    plan = reconcile_training(job(workers, **spec), [], NOW)
    assert plan.status["state"] == "Created", plan.status
    return {p["metadata"]["name"]: p for p in plan.create_pods}


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


TEMPLATE = {
    "metadata": {"labels": {"team": "recsys", names.LABEL_JOB: "hijack"}, "annotations": {"cost-center": "42"}},
    "spec": {
        "priorityClassName": "high",
        "nodeSelector": {"pool": "h100"},
        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
        "volumes": [{"name": "cache", "emptyDir": {}}, {"name": "creds", "secret": {"secretName": "s3"}}],
        "initContainers": [{"name": "warm", "image": "busybox", "command": ["true"]}],
        "containers": [
            {"name": "trainer",
             "env": [{"name": "AWS_KEY", "valueFrom": {"secretKeyRef": {"name": "s3", "key": "key"}}},
                     {"name": "HOME", "value": "/home/me"}],
             "envFrom": [{"configMapRef": {"name": "settings"}}],
             "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
             "resources": {"limits": {"memory": "64Gi"}}},
            {"name": "logship", "image": "fluent-bit", "volumeMounts": [{"name": "cache", "mountPath": "/c"}]},
        ],
    },
}


def test_template_overlay_merges_strategically() -> None:
    made = pods({"replicas": 2, "accelerator": "nvidia", "template": TEMPLATE,
                 "env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "tok", "key": "t"}}}],
                 "envFrom": [{"secretRef": {"name": "more"}}]})
    p = made["demo-worker-1"]
    meta, spec = p["metadata"], p["spec"]
    assert meta["labels"]["team"] == "recsys" and meta["labels"][names.LABEL_JOB] == "demo"  # operator wins
    assert meta["annotations"]["cost-center"] == "42" and "grstack.io/spec-hash" in meta["annotations"]
    assert spec["priorityClassName"] == "high" and spec["nodeSelector"] == {"pool": "h100"}
    assert spec["tolerations"][0]["key"] == "gpu" and "nodeAffinity" in spec["affinity"]
    assert spec["restartPolicy"] == "Never" and spec["subdomain"] == "demo-workers"
    volumes = [v["name"] for v in spec["volumes"]]
    assert {"config", "checkpoint", "tmp", "shm", "cache", "creds"} <= set(volumes)
    assert [c["name"] for c in spec["initContainers"]] == ["warm"]
    assert [c["name"] for c in spec["containers"]] == ["trainer", "logship"]
    trainer = spec["containers"][0]
    env = env_of(trainer)
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2"  # the operator's
    assert env["AWS_KEY"] == {"secretKeyRef": {"name": "s3", "key": "key"}}
    assert env["TOKEN"] == {"secretKeyRef": {"name": "tok", "key": "t"}}
    assert env["HOME"] == "/home/me"  # a default of the operator's, the user may change it
    assert [e["name"] for e in trainer["env"]].count("HOME") == 1
    assert trainer["envFrom"] == [{"secretRef": {"name": "more"}}, {"configMapRef": {"name": "settings"}}]
    mounts = {m["mountPath"] for m in trainer["volumeMounts"]}
    assert {"/cache", "/etc/grstack/train", "/var/grstack/run"} <= mounts
    assert trainer["resources"]["limits"] == {"memory": "64Gi", "nvidia.com/gpu": 1}
    assert trainer["command"] == ["grstack"] and trainer["image"] == "grstack:cpu"


@pytest.mark.parametrize(("workers", "needle"), [
    ({"env": [{"name": "WORLD_SIZE", "value": "8"}]}, "workers.env sets WORLD_SIZE"),
    ({"env": [{"name": "X", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]},
     "not both"),
    ({"template": {"spec": {"containers": [{"name": "trainer", "env": [{"name": "RANK", "value": "0"}]}]}}},
     "env RANK"),
    ({"template": {"spec": {"containers": [{"name": "trainer", "image": "other"}]}}}, "trainer].image"),
    ({"template": {"spec": {"restartPolicy": "Always"}}}, "spec.restartPolicy"),
    ({"template": {"spec": {"volumes": [{"name": "checkpoint", "emptyDir": {}}]}}}, "volumes checkpoint"),
    ({"template": {"spec": {"containers": [{"image": "x"}]}}}, "needs a name"),
    ({"nprocPerNode": 0}, "workers.nprocPerNode"),
])
def test_what_the_operator_sets_is_refused(workers: dict[str, Any], needle: str) -> None:
    plan = reconcile_training(job({"replicas": 2, **workers}), [], NOW)
    assert plan.status["state"] == "Failed" and not plan.create_pods
    cond = next(c for c in plan.status["conditions"] if c["type"] == "Failed")
    assert cond["reason"] == "InvalidSpec" and needle in cond["message"], cond["message"]


@pytest.mark.parametrize(("accelerator", "device"), [("nvidia", "nvidia.com/gpu"), ("ascend", "huawei.com/Ascend910")])
def test_nproc_per_node_env_args_and_devices(accelerator: str, device: str) -> None:
    made = pods({"replicas": 3, "nprocPerNode": 4, "accelerator": accelerator})
    for node in range(3):
        c = made[f"demo-worker-{node}"]["spec"]["containers"][0]
        env = env_of(c)
        assert env["WORLD_SIZE"] == "12" and env["RANK"] == str(4 * node)
        assert env["NODE_RANK"] == env["GROUP_RANK"] == str(node)
        assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("0", "4")
        assert c["args"][c["args"].index("--nproc") + 1] == "4"
        assert c["resources"]["limits"][device] == 4 and c["resources"]["requests"][device] == 4


def test_one_rank_per_pod_has_no_nproc() -> None:
    c = pods({"replicas": 2})["demo-worker-1"]["spec"]["containers"][0]
    env = env_of(c)
    assert "--nproc" not in c["args"]
    assert (env["WORLD_SIZE"], env["RANK"], env["NODE_RANK"], env["LOCAL_WORLD_SIZE"]) == ("2", "1", "1", "1")


def test_pod_env_agrees_with_the_trainer_launcher() -> None:
    """The env a pod gets, read by the trainer's launcher, gives each local rank its global RANK."""
    from grstack.runtime.train.launch import node_from_env, rank_env

    made = pods({"replicas": 2, "nprocPerNode": 2})
    seen = []
    for node in range(2):
        env = {k: v for k, v in env_of(made[f"demo-worker-{node}"]["spec"]["containers"][0]).items()
               if isinstance(v, str)}
        place = node_from_env(2, env)
        for local in range(2):
            r = rank_env(local, 2, 0, node=place)
            assert (r["LOCAL_RANK"], r["WORLD_SIZE"], r["MASTER_ADDR"]) == (str(local), "4", env["MASTER_ADDR"])
            seen.append(int(r["RANK"]))
    assert seen == [0, 1, 2, 3]


def test_the_schema_model_accepts_the_example_template() -> None:
    spec = parse_spec(job({"replicas": 2, "template": TEMPLATE}))
    assert spec.workers.template.metadata.labels["team"] == "recsys"


def _admit(spec: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    from opsim import admit_custom_resource

    from grstack.operator import crds

    schema = crds.crd(crds.TRAINING)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return admit_custom_resource({"apiVersion": names.API_VERSION, "kind": names.TRAINING_KIND,
                                  "metadata": {"name": "demo"}, "spec": spec}, schema)


def test_crd_keeps_the_template_unpruned_and_defaults_the_new_fields() -> None:
    stored, errors = _admit({"image": "x", "workers": {"replicas": 2, "template": TEMPLATE}})
    assert errors == []
    workers = stored["spec"]["workers"]
    assert workers["template"]["spec"] == TEMPLATE["spec"]  # x-kubernetes-preserve-unknown-fields
    assert workers["nprocPerNode"] == 1
    assert stored["spec"]["runPolicy"]["schedulingPolicy"] == {"gangScheduler": "None"}


@pytest.mark.parametrize(("spec", "where"), [
    ({"workers": {"nprocPerNode": 0}}, "nprocPerNode"),
    ({"runPolicy": {"schedulingPolicy": {"gangScheduler": "Kube"}}}, "gangScheduler"),
    ({"runPolicy": {"schedulingPolicy": {"scheduleTimeoutSeconds": 0}}}, "scheduleTimeoutSeconds"),
    ({"workers": {"template": {"metadata": {"labels": {"a": 1}}}}}, "labels"),
])
def test_crd_rejects_bad_new_fields(spec: dict[str, Any], where: str) -> None:
    _, errors = _admit({"image": "x", **spec})
    assert errors and where in " ".join(errors), errors
