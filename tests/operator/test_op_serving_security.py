"""GRRankingService ``auth`` and ``tls``: the Secrets mounted into rankers and routers, the flags they get (parsed by
the real ``grstack serve`` command line), HTTPS probes and URLs, and the specs refused."""

from __future__ import annotations

import argparse
import datetime as dt
from typing import Any

import pytest

from grstack.operator import names
from grstack.operator.serving import reconcile_serving, stats_targets
from grstack.runtime.serve import cli as serve_cli

pytestmark = pytest.mark.unit

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
SECRETS = "/var/run/secrets/grstack-serving"


def svc(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": names.API_VERSION, "kind": names.SERVING_KIND,
            "metadata": {"name": "rank", "namespace": "prod", "uid": "u", "generation": 1},
            "spec": {"image": "grstack:cpu", "checkpoint": {"path": "/models/best.pt"}, **spec}}


def pods(plan: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    by = {(c["kind"], c["metadata"]["name"]): c for c in plan.children}
    return (by[("StatefulSet", "rank-ranker")]["spec"]["template"]["spec"],
            by[("Deployment", "rank-router")]["spec"]["template"]["spec"])


def parse(args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cli.register(parser)
    # args start with "serve"; the kubelet expands $(VAR) from the container's environment first
    return parser.parse_args([a.replace("$(GRSTACK_POD_NAME)", "rank-ranker-0") for a in args[1:]])


def mounted(pod: dict[str, Any], path: str) -> str:
    """The Secret (name/key) that backs the file at ``path`` in ``pod``."""
    container = pod["containers"][0]
    for m in container["volumeMounts"]:
        if path.startswith(m["mountPath"] + "/"):
            vol = next(v for v in pod["volumes"] if v["name"] == m["name"])
            item = next(i for i in vol["secret"]["items"] if i["path"] == path[len(m["mountPath"]) + 1:])
            assert m["readOnly"] is True and vol["secret"]["defaultMode"] == 0o440
            return f"{vol['secret']['secretName']}/{item['key']}"
    raise AssertionError(f"{path} is not mounted")


def test_without_auth_or_tls_nothing_changes() -> None:
    ranker, router = pods(reconcile_serving(svc(), {}, [], NOW))
    for pod in (ranker, router):
        args = pod["containers"][0]["args"]
        assert not any(a.startswith(("--auth", "--tls", "--ranker-", "--open-paths")) for a in args)
        assert "scheme" not in pod["containers"][0]["readinessProbe"]["httpGet"]


def test_tokens_from_secrets() -> None:
    plan = reconcile_serving(svc(auth={"tokenSecret": "clients", "rankerTokenSecret": "internal",
                                       "rankerTokenKey": "token", "openPaths": ["healthz", "readyz", "metrics"]}),
                             {}, [], NOW)
    ranker, router = pods(plan)
    r, t = parse(ranker["containers"][0]["args"]), parse(router["containers"][0]["args"])
    assert mounted(ranker, r.auth_token_file) == "internal/token"
    assert mounted(router, t.auth_token_file) == "clients/tokens"
    assert mounted(router, t.ranker_token_file) == "internal/token"  # the router sends the rankers' token
    assert r.open_paths == t.open_paths == "healthz,readyz,metrics"
    assert not any(v.get("secret", {}).get("secretName") == "clients" for v in ranker["volumes"])  # not needed there
    assert all(m["mountPath"].startswith(SECRETS) for m in ranker["containers"][0]["volumeMounts"]
               if m["name"].endswith("tokens"))


def test_one_token_secret_serves_both() -> None:
    ranker, router = pods(reconcile_serving(svc(auth={"tokenSecret": "tokens"}), {}, [], NOW))
    r, t = parse(ranker["containers"][0]["args"]), parse(router["containers"][0]["args"])
    assert mounted(ranker, r.auth_token_file) == mounted(router, t.ranker_token_file) == "tokens/tokens"
    assert t.ranker_token_file == t.auth_token_file and r.open_paths == "healthz,readyz"


def test_tls_and_mtls() -> None:
    plan = reconcile_serving(svc(tls={"secretName": "rank-tls", "clientAuth": True}, etcd={"managed": True}),
                             {}, [], NOW)
    ranker, router = pods(plan)
    r, t = parse(ranker["containers"][0]["args"]), parse(router["containers"][0]["args"])
    assert mounted(ranker, r.tls_cert) == mounted(router, t.tls_cert) == "rank-tls/tls.crt"
    assert mounted(ranker, r.tls_key) == mounted(router, t.ranker_key) == "rank-tls/tls.key"
    assert mounted(ranker, r.tls_client_ca) == mounted(router, t.ranker_ca) == "rank-tls/ca.crt"
    assert mounted(router, t.ranker_cert) == "rank-tls/tls.crt" and t.ranker_server_name == "rank-ranker"
    assert t.tls_client_ca is None  # clients of the router need no certificate
    assert r.advertise_url.startswith("https://")
    for pod in (ranker, router):
        c = pod["containers"][0]
        assert c["readinessProbe"]["httpGet"]["scheme"] == c["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert plan.status["url"] == "https://rank.prod.svc:8080"


def test_tls_without_client_auth() -> None:
    ranker, router = pods(reconcile_serving(svc(tls={"secretName": "rank-tls"}), {}, [], NOW))
    r, t = parse(ranker["containers"][0]["args"]), parse(router["containers"][0]["args"])
    assert r.tls_client_ca is None and t.ranker_cert is None and t.ranker_ca.endswith("/ca.crt")


def test_stats_are_polled_over_https_with_tls() -> None:
    pod = {"metadata": {"labels": {names.LABEL_COMPONENT: "ranker"}}, "status": {"podIP": "10.0.0.5",
                                                                               "phase": "Running"}}
    assert stats_targets(svc(tls={"secretName": "t"}), [pod]) == ["https://10.0.0.5:8000/v1/stats"]
    assert stats_targets(svc(), [pod]) == ["http://10.0.0.5:8000/v1/stats"]


@pytest.mark.parametrize("spec, message", [
    ({"router": {"serviceType": "LoadBalancer"}}, "LoadBalancer exposes the routers"),
    ({"router": {"serviceType": "NodePort"}}, "set auth"),
    ({"auth": {"tokenSecret": "t", "openPaths": ["healthz"]}}, "must include readyz"),
    ({"tls": {"secretName": "t", "clientAuth": True}, "auth": {"tokenSecret": "t", "openPaths": ["metrics"]}},
     "must include healthz and readyz"),
    ({"auth": {"tokenSecret": "t", "openPaths": ["../etc"]}}, "openPaths"),
    ({"auth": {"tokenSecret": ""}}, "tokenSecret"),
])
def test_refused_specs(spec: dict[str, Any], message: str) -> None:
    plan = reconcile_serving(svc(**spec), {}, [], NOW)
    assert plan.children == []
    ready = next(c for c in plan.status["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "InvalidSpec" and message in ready["message"], ready["message"]


def test_load_balancer_with_auth_is_allowed() -> None:
    plan = reconcile_serving(svc(router={"serviceType": "LoadBalancer"}, auth={"tokenSecret": "t"}), {}, [], NOW)
    assert any(c["kind"] == "Service" and c["spec"].get("type") == "LoadBalancer" for c in plan.children)
