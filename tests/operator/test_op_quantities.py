"""Quantities compare by value: the API server stores them canonicalised ("0.5" as "500m"), so a ranking service
whose spec says "0.5", "1000m", "4096Mi" or "1.5Gi" must read its children back as rolled out, not as
"being updated" forever (and the operator must not re-patch them on every pass)."""

from __future__ import annotations

import datetime as dt
import json
from decimal import ROUND_CEILING, Decimal
from typing import Any

import pytest
from kubernetes.utils.quantity import parse_quantity

from grstack.operator import names, objects, quantity
from grstack.operator.models import Resources
from grstack.operator.serving import reconcile_serving

pytestmark = pytest.mark.unit

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
NANO = Decimal("1e-9")

SUFFIXES = ["n", "u", "m", "", "k", "M", "G", "T", "P", "E", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"]
NUMBERS = ["1", "0.5", "1.5", "12", ".25", "3.", "+2", "-7", "1000"]


@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize("number", NUMBERS)
def test_every_suffix_parses_as_the_kubernetes_client_does(number: str, suffix: str) -> None:
    """The same values as kubernetes.utils.quantity, except below a nano, which the API server rounds up."""
    text = number + suffix
    expected = parse_quantity(text)
    exponent = expected.as_tuple().exponent
    if isinstance(exponent, int) and exponent < -9:
        expected = expected.quantize(NANO, rounding=ROUND_CEILING)
    assert quantity.parse(text) == expected, text


@pytest.mark.parametrize("text", ["1e3", "1E3", "2.5e2", "1e-3", "5e+2", "12e0", "-1e6", ".5e1"])
def test_decimal_exponents(text: str) -> None:
    assert quantity.parse(text) == parse_quantity(text) == Decimal(text)


@pytest.mark.parametrize("value", [0, 1, 2, 1000, 64])
def test_integers(value: int) -> None:
    assert quantity.parse(value) == Decimal(value)


@pytest.mark.parametrize("text", ["", "m", "Gi", "1ki", "1K", "1 Gi", "1.2.3", "1e", "1e1.5", "abc", "1Gib", "--1",
                                  "1mi"])
def test_what_the_api_server_refuses_is_no_quantity(text: str) -> None:
    with pytest.raises(ValueError, match="not a quantity"):
        quantity.parse(text)


def test_values_finer_than_a_nano_round_up_as_in_the_api_server() -> None:
    assert quantity.parse("0.1n") == quantity.parse("1n") == Decimal("1e-9")


# (what a spec says, what kube-apiserver stores: resource.Quantity's canonical string)
CANONICAL = [("0.5", "500m"), ("1000m", "1"), ("4096Mi", "4Gi"), ("1.5Gi", "1536Mi"), ("1e3", "1e3"),
             ("1000", "1k"), (1000, "1k"), ("2000m", 2), ("0.25Ki", "256"), ("1.5k", "1500"), ("5E", "5E"),
             ("1024Ki", "1Mi"), ("0.001", "1m"), ("1e-3", "1m")]


@pytest.mark.parametrize(("desired", "stored"), CANONICAL)
def test_equal_by_value(desired: Any, stored: Any) -> None:
    assert quantity.equal(desired, stored)


@pytest.mark.parametrize(("a", "b"), [("1Gi", "1G"), ("500m", "0.6"), ("1k", "1Ki"), ("1", "1m"), ("x", "y")])
def test_different_values_differ(a: Any, b: Any) -> None:
    assert not quantity.equal(a, b)


def test_covers_compares_quantities_by_value_and_nothing_else() -> None:
    desired = {"resources": {"requests": {"cpu": "0.5", "memory": "4096Mi"}, "limits": {"cpu": "1000m"}},
               "volumes": [{"name": "model", "emptyDir": {"sizeLimit": "1.5Gi"}}],
               "env": [{"name": "N", "value": "1000"}]}
    live = {"resources": {"requests": {"cpu": "500m", "memory": "4Gi"}, "limits": {"cpu": "1"}},
            "volumes": [{"name": "model", "emptyDir": {"sizeLimit": "1536Mi"}}],
            "env": [{"name": "N", "value": "1000"}]}
    assert objects.covers(desired, live)
    # an environment value is text, whatever it looks like
    assert not objects.covers(desired, {**live, "env": [{"name": "N", "value": "1k"}]})
    assert not objects.covers(desired, {**live, "resources": {"requests": {"cpu": "600m", "memory": "4Gi"},
                                                              "limits": {"cpu": "1"}}})
    assert not objects.covers(desired, {**live, "resources": {"requests": {"cpu": "500m"}, "limits": {"cpu": "1"}}})


def test_a_bad_quantity_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"requests\.cpu"):
        Resources.model_validate({"requests": {"cpu": "lots"}})


def test_a_request_above_its_limit_is_refused_by_value() -> None:
    """The API server refuses such a pod template; compared by value, "1.5Gi" is below "4096Mi"."""
    with pytest.raises(ValueError, match=r"requests\.memory 8Gi is above limits\.memory 4096Mi"):
        Resources.model_validate({"requests": {"memory": "8Gi"}, "limits": {"memory": "4096Mi"}})
    Resources.model_validate({"requests": {"memory": "1.5Gi", "cpu": "2"}, "limits": {"memory": "4096Mi"}})


# ------------------------------------------------------------------------------- the ranking service, Ready


def _canonicalise(node: Any, key: str = "") -> Any:
    """What the API server stores for the operator's objects, for the quantities used below."""
    stored = dict(CANONICAL[:4])
    if isinstance(node, dict):
        return {k: (stored.get(v, v) if k in ("cpu", "memory", "sizeLimit") and isinstance(v, str)
                    else _canonicalise(v, k)) for k, v in node.items()}
    if isinstance(node, list):
        return [_canonicalise(v, key) for v in node]
    return node


def _service() -> dict[str, Any]:
    return {"apiVersion": names.API_VERSION, "kind": names.SERVING_KIND,
            "metadata": {"name": "rank", "namespace": "prod", "uid": "u-1", "generation": 1},
            "spec": {"image": "grstack:cpu", "checkpoint": "s3://models/run/model.pt",
                     "storage": {"sizeLimit": "1.5Gi"},
                     "ranker": {"resources": {"requests": {"cpu": "0.5", "memory": "1.5Gi"},
                                              "limits": {"cpu": "1000m", "memory": "4096Mi"}}},
                     "router": {"resources": {"requests": {"cpu": "0.5"}}}}}


def test_non_canonical_quantities_reach_ready() -> None:
    first = reconcile_serving(_service(), {}, [], NOW)
    observed: dict[tuple[str, str], dict[str, Any]] = {}
    for child in first.children:
        if child["kind"] in ("StatefulSet", "Deployment"):
            live = _canonicalise(json.loads(json.dumps(child)))
            live["metadata"]["generation"] = 1
            live["status"] = {"observedGeneration": 1, "replicas": 1, "readyReplicas": 1, "availableReplicas": 1,
                              "updatedReplicas": 1}
            observed[(child["kind"], child["metadata"]["name"])] = live
    sts = observed[("StatefulSet", "rank-ranker")]["spec"]["template"]["spec"]
    assert sts["containers"][0]["resources"]["requests"] == {"cpu": "500m", "memory": "1536Mi"}  # as stored
    assert next(v for v in sts["volumes"] if v["name"] == "model")["emptyDir"] == {"sizeLimit": "1536Mi"}
    plan = reconcile_serving(_service(), observed, [], NOW)
    ready = next(c for c in plan.status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "AllReplicasReady"), ready
    for child in plan.children:  # nothing left to patch: the handlers' ensure() would leave them alone
        key = (child["kind"], child["metadata"]["name"])
        if key in observed:
            assert objects.covers(child, observed[key]), key
