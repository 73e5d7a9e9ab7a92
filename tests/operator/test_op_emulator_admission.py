"""The emulator's validating admission (opsim_admission): Pod Security and ResourceQuota refusals worded as
kube-apiserver words them."""

from __future__ import annotations

from typing import Any

import kmock
import opsim_admission as adm
import pytest

pytestmark = pytest.mark.unit

PODS = kmock.resource("v1/pods")
RESTRICTED = {adm.ENFORCE_LABEL: "restricted"}


def pod(name: str = "x", **spec: Any) -> dict[str, Any]:
    spec.setdefault("containers", [{"name": "c", "image": "busybox"}])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "ns"}, "spec": spec}


def refusal(obj: dict[str, Any], labels: dict[str, str] | None = None, live: list[dict[str, Any]] | None = None,
            quotas: list[dict[str, Any]] | None = None, resource: Any = PODS, same: int = 0) -> kmock.KubernetesError:
    with pytest.raises(kmock.KubernetesError) as info:
        adm.admit_create(resource, obj, labels or {}, live or [], quotas or [], same)
    return info.value


def test_a_bare_pod_in_a_restricted_namespace_gets_the_api_servers_message() -> None:
    err = refusal(pod(), RESTRICTED)
    assert err.status == 403 and err.reason == "Forbidden"
    assert err.message == (
        'pods "x" is forbidden: violates PodSecurity "restricted:latest": allowPrivilegeEscalation != false '
        '(container "c" must set securityContext.allowPrivilegeEscalation=false), unrestricted capabilities '
        '(container "c" must set securityContext.capabilities.drop=["ALL"]), runAsNonRoot != true (pod or '
        'container "c" must set securityContext.runAsNonRoot=true), seccompProfile (pod or container "c" must '
        'set securityContext.seccompProfile.type to "RuntimeDefault" or "Localhost")')


RESTRICTED_CONTAINER = {"name": "c", "image": "busybox", "securityContext": {
    "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}
RESTRICTED_POD = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}


def test_a_restricted_pod_passes_and_other_namespaces_admit_anything() -> None:
    adm.admit_create(PODS, pod(containers=[RESTRICTED_CONTAINER], securityContext=RESTRICTED_POD), RESTRICTED,
                     [], [])
    adm.admit_create(PODS, pod(hostNetwork=True), {}, [], [])
    adm.admit_create(PODS, pod(hostNetwork=True), {adm.ENFORCE_LABEL: "privileged"}, [], [])


def test_host_access_is_listed_check_by_check() -> None:
    container = {**RESTRICTED_CONTAINER, "ports": [{"containerPort": 80, "hostPort": 80}],
                 "securityContext": {**RESTRICTED_CONTAINER["securityContext"], "privileged": True,
                                     "capabilities": {"drop": ["ALL"], "add": ["SYS_ADMIN"]}, "runAsUser": 0}}
    obj = pod(containers=[container], securityContext=RESTRICTED_POD, hostNetwork=True, hostPID=True,
              volumes=[{"name": "root", "hostPath": {"path": "/"}}])
    message = refusal(obj, RESTRICTED).message
    assert message.split(": violates ")[1] == (
        'PodSecurity "restricted:latest": unrestricted capabilities (container "c" must not include "SYS_ADMIN" '
        'in securityContext.capabilities.add), host namespaces (hostNetwork=true, hostPID=true), hostPort '
        '(container "c" uses hostPort 80), privileged (container "c" must not set securityContext.privileged=true), '
        'restricted volume types (volume "root" uses restricted volume type "hostPath"), runAsUser=0 (container "c" '
        'must not set runAsUser=0)')
    baseline = refusal(obj, {adm.ENFORCE_LABEL: "baseline"}).message
    assert 'violates PodSecurity "baseline:latest": non-default capabilities' in baseline
    assert 'hostPath volumes (volume "root")' in baseline and "runAsUser" not in baseline


def test_explicit_root_and_unconfined_are_named() -> None:
    container = {**RESTRICTED_CONTAINER, "securityContext": {**RESTRICTED_CONTAINER["securityContext"],
                                                             "runAsNonRoot": False,
                                                             "seccompProfile": {"type": "Unconfined"}}}
    message = refusal(pod(containers=[container], securityContext=RESTRICTED_POD), RESTRICTED).message
    assert 'runAsNonRoot != true (container "c" must not set securityContext.runAsNonRoot=false)' in message
    assert 'seccompProfile (container "c" must not set securityContext.seccompProfile.type to "Unconfined")' \
        in message


def _quota(**hard: str) -> dict[str, Any]:
    return {"metadata": {"name": "compute", "namespace": "ns"}, "spec": {"hard": hard}}


def _with_requests(name: str, **requests: str) -> dict[str, Any]:
    return pod(name, containers=[{"name": "c", "image": "i", "resources": {"requests": requests}}])


def test_quota_exceeded_is_worded_as_the_api_server() -> None:
    live = [_with_requests("a", memory="768Mi", cpu="500m")]
    err = refusal(_with_requests("b", memory="768Mi", cpu="1"), quotas=[_quota(**{"requests.memory": "1Gi",
                                                                                  "requests.cpu": "4"})], live=live)
    assert err.status == 403 and err.message == (
        'pods "b" is forbidden: exceeded quota: compute, requested: requests.memory=768Mi, used: '
        'requests.memory=768Mi, limited: requests.memory=1Gi')
    err = refusal(_with_requests("b", memory="1"), quotas=[_quota(pods="1")], live=live)
    assert err.message == 'pods "b" is forbidden: exceeded quota: compute, requested: pods=1, used: pods=1, ' \
                          'limited: pods=1'


def test_finished_pods_do_not_count_and_missing_requests_are_refused() -> None:
    done = _with_requests("a", memory="1Gi")
    done["status"] = {"phase": "Succeeded"}
    adm.admit_create(PODS, _with_requests("b", memory="1Gi"), {}, [done], [_quota(**{"requests.memory": "1Gi"})])
    err = refusal(pod("b"), quotas=[_quota(**{"limits.memory": "1Gi"})])
    assert err.message == 'pods "b" is forbidden: failed quota: compute: must specify limits.memory for: c'


def test_object_counts() -> None:
    deployments = kmock.resource("apps/v1/deployments")
    obj = {"metadata": {"name": "d", "namespace": "ns"}}
    err = refusal(obj, quotas=[_quota(**{"count/deployments.apps": "2"})], resource=deployments, same=2)
    assert err.message == ('deployments.apps "d" is forbidden: exceeded quota: compute, requested: '
                           'count/deployments.apps=1, used: count/deployments.apps=2, limited: count/deployments.apps=2')
    adm.admit_create(deployments, obj, {}, [], [_quota(**{"count/deployments.apps": "2"})], 1)
    err = refusal(obj, quotas=[_quota(services="0")], resource=kmock.resource("v1/services"))
    assert err.message.startswith('services "d" is forbidden: exceeded quota: compute, requested: services=1')


@pytest.mark.parametrize(("value", "like", "text"), [
    (768 * 2 ** 20, "1Gi", "768Mi"), (2 ** 30, "2Gi", "1Gi"), (3, "8", "3"), (0, "1Gi", "0"),
    (5000, "10k", "5k"), (1.5, "4", "1500m")])
def test_quantities_print_in_the_limits_notation(value: float, like: str, text: str) -> None:
    from decimal import Decimal
    assert adm.format_quantity(Decimal(str(value)), like) == text
