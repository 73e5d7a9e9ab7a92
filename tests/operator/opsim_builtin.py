"""What kube-apiserver does to a Pod, Service, StatefulSet or Deployment before it stores it, for the emulator
(opsim.py): decoding against the published OpenAPI schemas (the ``kubernetes-validate`` package's strict JSON
schemas: unknown fields refused under ``fieldValidation=Strict``, dropped otherwise; wrong types refused as
undecodable), defaulting, quantity canonicalisation, and the semantic validation the real server adds (names,
ports, required and immutable fields), answered as the API server answers (400 ``BadRequest`` for what cannot
be decoded, 422 ``Invalid`` with the field errors in its wording).

Only what the clients here can trip on is modelled; the Go validation has many more rules.
"""

from __future__ import annotations

import copy
import decimal
import functools
import hashlib
import json
import re
from decimal import Decimal
from typing import Any

import jsonschema
import kubernetes_validate
import referencing
from kubernetes.utils.quantity import parse_quantity
from kubernetes_validate.utils import latest_version

# kind -> (apiVersion, group, schema file stem, name rule)
KINDS = {
    "Pod": ("v1", "", "pod-v1", "subdomain"),
    "Service": ("v1", "", "service-v1", "dns1035"),
    "StatefulSet": ("apps/v1", "apps", "statefulset-apps-v1", "subdomain"),
    "Deployment": ("apps/v1", "apps", "deployment-apps-v1", "subdomain"),
}


class Refused(Exception):
    """The API server's answer to a request it will not store: an HTTP code, a reason and a Status message."""

    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any]) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details


# ------------------------------------------------------------------------------------------- quantities

_QUANTITY = re.compile(r"^([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?$")
QUANTITY_MESSAGE = "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
_DEC_SUFFIX = {-9: "n", -6: "u", -3: "m", 0: "", 3: "k", 6: "M", 9: "G", 12: "T", 15: "P", 18: "E"}
_BIN_SUFFIX = {0: "", 10: "Ki", 20: "Mi", 30: "Gi", 40: "Ti", 50: "Pi", 60: "Ei"}


def parse(text: Any) -> tuple[Decimal, str]:
    """(value, format) of a quantity: format ``BinarySI``, ``DecimalSI`` or ``DecimalExponent`` as the suffix
    says; ValueError for what resource.ParseQuantity refuses. The value comes from kubernetes.utils.quantity."""
    raw = str(text) if not isinstance(text, bool) else "x"
    if isinstance(text, float):
        raw = repr(text)
    m = _QUANTITY.match(raw)
    if m is None:
        raise ValueError(QUANTITY_MESSAGE)
    suffix = m.group(2) or ""
    exponent = len(suffix) > 1 and suffix[0] in "eE" and not suffix.endswith("i")
    fmt = "BinarySI" if suffix.endswith("i") else "DecimalExponent" if exponent else "DecimalSI"
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        try:
            value = Decimal(raw) if exponent else parse_quantity(raw)
            # resource.Quantity keeps nano precision: anything finer is rounded up (away from zero)
            value = value.quantize(Decimal("1e-9"), rounding=decimal.ROUND_UP)
        except (ArithmeticError, ValueError) as exc:
            raise ValueError(QUANTITY_MESSAGE) from exc
    return value, fmt


def canonical(text: Any) -> str:
    """The string kube-apiserver stores for a quantity (resource.Quantity.String): the largest suffix (a power
    of 1000, or of 1024 for binary-suffixed input that is a whole number of at least 1024) that leaves an
    integer mantissa; ``0.5`` -> ``500m``, ``1000m`` -> ``1``, ``4096Mi`` -> ``4Gi``, ``1.5Gi`` -> ``1536Mi``."""
    value, fmt = parse(text)
    if value == 0:
        return "0"
    if fmt == "BinarySI" and (abs(value) < 1024 or value != value.to_integral_value()):
        fmt = "DecimalSI"
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        if fmt == "BinarySI":
            mantissa, power = int(value), 0
            while power < 60 and mantissa % 1024 == 0:
                mantissa //= 1024
                power += 10
            return f"{mantissa}{_BIN_SUFFIX[power]}"
        exponent = -9
        mantissa = int(value.scaleb(9))
        while exponent < 18 and mantissa % 1000 == 0:
            mantissa //= 1000
            exponent += 3
        if fmt == "DecimalExponent":
            return f"{mantissa}e{exponent}" if exponent else str(mantissa)
        return f"{mantissa}{_DEC_SUFFIX[exponent]}"


# ------------------------------------------------------------------------------------------ field errors

LABEL_MSG = ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start "
             "and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is "
             "'[a-z0-9]([-a-z0-9]*[a-z0-9])?')")
SUBDOMAIN_MSG = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and "
                 "must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation "
                 "is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
DNS1035_MSG = ("a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic "
               "character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for "
               "validation is '[a-z]([-a-z0-9]*[a-z0-9])?')")
LABEL_VALUE_MSG = ("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', "
                   "and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or "
                   "'12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')")
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_QUALIFIED = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")


def _go(value: Any) -> str:
    """A value as Go's field errors print it (strings quoted, numbers and booleans bare)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float):
        return str(value)
    return json.dumps(value, separators=(",", ":"))


class Errors(list[tuple[str, str, str]]):
    """(field, reason, message) in the API server's order and words."""

    def invalid(self, field: str, value: Any, detail: str) -> None:
        self.append((field, "FieldValueInvalid", f"Invalid value: {_go(value)}: {detail}"))

    def invalid_go(self, field: str, value: str, detail: str) -> None:
        """A value printed by Go's %#v (a struct or map), not quoted."""
        self.append((field, "FieldValueInvalid", f"Invalid value: {value}: {detail}"))

    def required(self, field: str, detail: str = "") -> None:
        self.append((field, "FieldValueRequired", "Required value" + (f": {detail}" if detail else "")))

    def duplicate(self, field: str, value: Any) -> None:
        self.append((field, "FieldValueDuplicate", f"Duplicate value: {_go(value)}"))

    def unsupported(self, field: str, value: Any, supported: tuple[str, ...]) -> None:
        self.append((field, "FieldValueNotSupported", f"Unsupported value: {_go(value)}: supported values: "
                     + ", ".join(f'"{s}"' for s in supported)))

    def not_found(self, field: str, value: Any) -> None:
        self.append((field, "FieldValueNotFound", f"Not found: {_go(value)}"))

    def forbidden(self, field: str, detail: str) -> None:
        self.append((field, "FieldValueForbidden", f"Forbidden: {detail}"))


def dns_label(errs: Errors, field: str, value: Any) -> None:
    if not isinstance(value, str) or not _LABEL.fullmatch(value):
        errs.invalid(field, value, LABEL_MSG)
    if isinstance(value, str) and len(value) > 63:
        errs.invalid(field, value, "must be no more than 63 characters")


def dns_subdomain(errs: Errors, field: str, value: Any) -> None:
    if not isinstance(value, str) or not _SUBDOMAIN.fullmatch(value):
        errs.invalid(field, value, SUBDOMAIN_MSG)
    if isinstance(value, str) and len(value) > 253:
        errs.invalid(field, value, "must be no more than 253 characters")


def dns1035(errs: Errors, field: str, value: Any) -> None:
    if not isinstance(value, str) or not _DNS1035.fullmatch(value):
        errs.invalid(field, value, DNS1035_MSG)
    if isinstance(value, str) and len(value) > 63:
        errs.invalid(field, value, "must be no more than 63 characters")


def labels(errs: Errors, field: str, values: Any) -> None:
    for key, value in (values or {}).items():
        prefix, _, name = key.rpartition("/")
        if not _QUALIFIED.fullmatch(name) or len(name) > 63 or (prefix and not _SUBDOMAIN.fullmatch(prefix)):
            errs.invalid(field, key, "name part must consist of alphanumeric characters, '-', '_' or '.', and must "
                         "start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or "
                         "'123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')")
        if not isinstance(value, str) or not _LABEL_VALUE.fullmatch(value):
            errs.invalid(field, value, LABEL_VALUE_MSG)
        elif len(value) > 63:
            errs.invalid(field, value, "must be no more than 63 characters")


def port_number(errs: Errors, field: str, value: Any, low: int = 1) -> None:
    if not isinstance(value, int) or not low <= value <= 65535:
        errs.invalid(field, value, f"must be between {low} and 65535, inclusive")


def port_name(errs: Errors, field: str, value: str) -> None:
    """IANA_SVC_NAME, as container port names and named target ports must be."""
    if len(value) > 15:
        errs.invalid(field, value, "must be no more than 15 characters")
    if not re.fullmatch(r"[-a-z0-9]+", value):
        errs.invalid(field, value, "must contain only alpha-numeric characters (a-z, 0-9), and hyphens (-)")
    if "--" in value:
        errs.invalid(field, value, "must not contain consecutive hyphens")
    if not re.search(r"[a-z]", value):
        errs.invalid(field, value, "must contain at least one letter (a-z)")
    if value.startswith("-") or value.endswith("-"):
        errs.invalid(field, value, "must not begin or end with a hyphen")


# ------------------------------------------------------------------------------------------- decoding


@functools.cache
def _validator(kind: str) -> jsonschema.protocols.Validator:
    """The strict published schema of a kind (kubernetes-validate's newest version), with its definitions."""
    version = latest_version()
    stem = KINDS[kind][2]
    directory = f"kubernetes-json-schema/v{version}-local-strict"
    schema = kubernetes_validate.utils.schema_contents(f"{directory}/{stem}.json", version)
    defs = kubernetes_validate.utils.schema_contents(f"{directory}/_definitions.json", version)
    registry: referencing.Registry[Any] = referencing.Resource.from_contents(schema) @ referencing.Registry()
    registry = referencing.Resource.from_contents(defs) @ registry
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


def _field(path: Any) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def decode(kind: str, obj: dict[str, Any], strict: bool) -> tuple[dict[str, Any], Errors]:
    """The object as the server decodes it: unknown fields dropped (or, ``strict``, refused with 400 as
    ``fieldValidation=Strict`` does), wrong types refused with 400; missing required fields as 422 errors."""
    api_version = KINDS[kind][0]
    errs = Errors()
    unknown: list[str] = []
    undecodable: list[str] = []
    out = copy.deepcopy(obj)
    for err in _validator(kind).iter_errors(obj):
        where = list(err.absolute_path)
        if err.validator == "additionalProperties" and isinstance(err.instance, dict):
            known = err.schema.get("properties") or {}
            for key in [k for k in err.instance if k not in known]:
                unknown.append(_field([*where, key]))
                node = out
                for part in where:
                    node = node[part]
                node.pop(key, None)
        elif err.validator == "required" and isinstance(err.instance, dict):
            for key in err.validator_value:
                if key not in err.instance:
                    errs.required(_field([*where, key]))
        elif err.validator in ("type", "oneOf", "anyOf"):
            want = err.validator_value if err.validator == "type" else "the declared type"
            undecodable.append(f"json: cannot unmarshal {type(err.instance).__name__} into Go struct field "
                               f"{kind}.{_field(where)} of type {want}")
        elif err.validator == "enum" and where in (["apiVersion"], ["kind"]):
            continue  # the URL decides the kind; a mismatch is caught by KMock's routing
    if strict and unknown:
        raise Refused(400, "BadRequest", f'{kind} in version "{api_version.split("/")[-1]}" cannot be handled as a '
                      f"{kind}: " + "; ".join(f'strict decoding error: unknown field "{f}"' for f in unknown), {})
    if undecodable:
        raise Refused(400, "BadRequest", f'{kind} in version "{api_version.split("/")[-1]}" cannot be handled as a '
                      f"{kind}: {undecodable[0]}", {})
    return out, errs


# ------------------------------------------------------------------------------------------- defaulting

_PROBE = {"timeoutSeconds": 1, "periodSeconds": 10, "successThreshold": 1, "failureThreshold": 3}


def _default_container(c: dict[str, Any]) -> None:
    image = str(c.get("image") or "")
    tag = image.rpartition("/")[2]
    latest = "@" not in image and (":" not in tag or tag.endswith(":latest"))
    c.setdefault("imagePullPolicy", "Always" if latest else "IfNotPresent")
    c.setdefault("terminationMessagePath", "/dev/termination-log")
    c.setdefault("terminationMessagePolicy", "File")
    c.setdefault("resources", {})
    for port in c.get("ports") or []:
        port.setdefault("protocol", "TCP")
    for probe_key in ("livenessProbe", "readinessProbe", "startupProbe"):
        probe = c.get(probe_key)
        if isinstance(probe, dict):
            for key, value in _PROBE.items():
                probe.setdefault(key, value)
            if isinstance(probe.get("httpGet"), dict):
                probe["httpGet"].setdefault("scheme", "HTTP")
    for item in c.get("env") or []:
        ref = (item.get("valueFrom") or {}).get("fieldRef")
        if isinstance(ref, dict):
            ref.setdefault("apiVersion", "v1")


def default_pod_spec(spec: dict[str, Any]) -> None:
    """SetDefaults_PodSpec and its containers, volumes and probes (the fields a client sees filled in)."""
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("securityContext", {})
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("enableServiceLinks", True)
    for group in ("initContainers", "containers"):
        for c in spec.get(group) or []:
            _default_container(c)
    for vol in spec.get("volumes") or []:
        for source in ("configMap", "secret", "downwardAPI", "projected"):
            if isinstance(vol.get(source), dict):
                vol[source].setdefault("defaultMode", 420)
        if isinstance(vol.get("hostPath"), dict):
            vol["hostPath"].setdefault("type", "")


def _default_template(spec: dict[str, Any]) -> None:
    template = spec.setdefault("template", {})
    template.setdefault("metadata", {})
    if isinstance(template.get("spec"), dict):
        default_pod_spec(template["spec"])


def _qos(spec: dict[str, Any]) -> str:
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    res = [c.get("resources") or {} for c in containers]
    if not any((r.get("requests") or {}) or (r.get("limits") or {}) for r in res):
        return "BestEffort"
    guaranteed = all(
        {"cpu", "memory"} <= set(r.get("limits") or {})
        and all((r.get("requests") or {}).get(k, v) == v for k, v in (r.get("limits") or {}).items())
        for r in res)
    return "Guaranteed" if guaranteed else "Burstable"


class Defaults:
    """Per-server defaulting state: the Service cluster IPs handed out."""

    def __init__(self) -> None:
        self._next_ip = 1

    def apply(self, kind: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        spec = obj.setdefault("spec", {})
        if kind == "Pod":
            default_pod_spec(spec)
            spec.setdefault("serviceAccountName", "default")
            spec.setdefault("serviceAccount", spec["serviceAccountName"])
            for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
                res = c.get("resources") or {}
                if res.get("limits"):  # SetDefaults_Pod: a limit without a request requests the limit
                    res["requests"] = {**res["limits"], **(res.get("requests") or {})}
            if old is None:
                obj["status"] = {"phase": "Pending", "qosClass": _qos(spec)}
        elif kind == "Service":
            spec.setdefault("type", "ClusterIP")
            spec.setdefault("sessionAffinity", "None")
            for port in spec.get("ports") or []:
                port.setdefault("protocol", "TCP")
                port.setdefault("targetPort", port.get("port"))
            if spec["type"] != "ExternalName":
                old_spec = (old or {}).get("spec") or {}
                if not spec.get("clusterIP") and old_spec.get("clusterIP"):
                    spec["clusterIP"] = old_spec["clusterIP"]  # an update that omits it keeps the allocated one
                if not spec.get("clusterIP"):
                    spec["clusterIP"] = f"10.96.{self._next_ip // 254}.{self._next_ip % 254 + 1}"
                    self._next_ip += 1
                spec.setdefault("clusterIPs", [spec["clusterIP"]])
                spec.setdefault("ipFamilies", ["IPv4"])
                spec.setdefault("ipFamilyPolicy", "SingleStack")
                spec.setdefault("internalTrafficPolicy", "Cluster")
            if old is None:
                obj["status"] = {"loadBalancer": {}}
        elif kind == "StatefulSet":
            spec.setdefault("replicas", 1)
            spec.setdefault("podManagementPolicy", "OrderedReady")
            strategy = spec.setdefault("updateStrategy", {"type": "RollingUpdate"})
            strategy.setdefault("type", "RollingUpdate")
            if strategy["type"] == "RollingUpdate":
                strategy.setdefault("rollingUpdate", {}).setdefault("partition", 0)
            spec.setdefault("revisionHistoryLimit", 10)
            spec.setdefault("persistentVolumeClaimRetentionPolicy", {"whenDeleted": "Retain", "whenScaled": "Retain"})
            for claim in spec.get("volumeClaimTemplates") or []:
                claim.setdefault("apiVersion", "v1")
                claim.setdefault("kind", "PersistentVolumeClaim")
                claim.setdefault("spec", {}).setdefault("volumeMode", "Filesystem")
                claim.setdefault("status", {"phase": "Pending"})
            _default_template(spec)
            if old is None:
                obj["status"] = {"replicas": 0, "availableReplicas": 0}
        elif kind == "Deployment":
            spec.setdefault("replicas", 1)
            strategy = spec.setdefault("strategy", {"type": "RollingUpdate"})
            strategy.setdefault("type", "RollingUpdate")
            if strategy["type"] == "RollingUpdate":
                rolling = strategy.setdefault("rollingUpdate", {})
                rolling.setdefault("maxUnavailable", "25%")
                rolling.setdefault("maxSurge", "25%")
            spec.setdefault("revisionHistoryLimit", 10)
            spec.setdefault("progressDeadlineSeconds", 600)
            _default_template(spec)
            if old is None:
                obj["status"] = {}


# --------------------------------------------------------------------------------- canonical quantities


def _canonicalise_map(errs: Errors, field: str, values: Any) -> None:
    if not isinstance(values, dict):
        return
    for key, value in list(values.items()):
        try:
            values[key] = canonical(value)
        except ValueError as exc:
            raise Refused(400, "BadRequest", str(exc), {}) from exc
        if parse(values[key])[0] < 0:
            errs.invalid(f"{field}[{key}]", values[key], "must be greater than or equal to 0")


def _pod_quantities(errs: Errors, prefix: str, spec: dict[str, Any]) -> None:
    for group in ("initContainers", "containers", "ephemeralContainers"):
        for i, c in enumerate(spec.get(group) or []):
            res = c.get("resources") or {}
            where = f"{prefix}.{group}[{i}].resources"
            _canonicalise_map(errs, f"{where}.limits", res.get("limits"))
            _canonicalise_map(errs, f"{where}.requests", res.get("requests"))
            limits = res.get("limits") or {}
            for key, value in (res.get("requests") or {}).items():
                if key in limits and parse(value)[0] > parse(limits[key])[0]:
                    errs.invalid(f"{where}.requests", value, f"must be less than or equal to {key} limit of "
                                 f"{limits[key]}")
    _canonicalise_map(errs, f"{prefix}.overhead", spec.get("overhead"))
    for key in ("limits", "requests"):
        _canonicalise_map(errs, f"{prefix}.resources.{key}", (spec.get("resources") or {}).get(key))
    for i, vol in enumerate(spec.get("volumes") or []):
        empty = vol.get("emptyDir")
        if isinstance(empty, dict) and "sizeLimit" in empty:
            try:
                empty["sizeLimit"] = canonical(empty["sizeLimit"])
            except ValueError as exc:
                raise Refused(400, "BadRequest", str(exc), {}) from exc
            if parse(empty["sizeLimit"])[0] < 0:
                errs.invalid(f"{prefix}.volumes[{i}].emptyDir.sizeLimit", empty["sizeLimit"],
                             "must be greater than or equal to 0")


# ------------------------------------------------------------------------------------------- validation

RESTART = ("Always", "OnFailure", "Never")
DNS_POLICIES = ("ClusterFirst", "ClusterFirstWithHostNet", "Default", "None")
PROTOCOLS = ("SCTP", "TCP", "UDP")


def validate_pod_spec(errs: Errors, prefix: str, spec: dict[str, Any], template: bool) -> None:
    volumes: set[str] = set()
    for i, vol in enumerate(spec.get("volumes") or []):
        where = f"{prefix}.volumes[{i}].name"
        dns_label(errs, where, vol.get("name", ""))
        if vol.get("name") in volumes:
            errs.duplicate(where, vol.get("name"))
        volumes.add(vol.get("name", ""))
    containers = spec.get("containers")
    if not containers:
        errs.required(f"{prefix}.containers")
    seen: set[str] = set()
    for group in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(group) or []):
            where = f"{prefix}.{group}[{i}]"
            name = c.get("name", "")
            if not name:
                errs.required(f"{where}.name")
            else:
                dns_label(errs, f"{where}.name", name)
                if name in seen:
                    errs.duplicate(f"{where}.name", name)
                seen.add(name)
            if not c.get("image"):
                errs.required(f"{where}.image")
            port_names: set[str] = set()
            for j, port in enumerate(c.get("ports") or []):
                pw = f"{where}.ports[{j}]"
                if "containerPort" not in port:
                    errs.required(f"{pw}.containerPort")
                else:
                    port_number(errs, f"{pw}.containerPort", port["containerPort"])
                if port.get("hostPort"):
                    port_number(errs, f"{pw}.hostPort", port["hostPort"])
                if port.get("name"):
                    port_name(errs, f"{pw}.name", port["name"])
                    if port["name"] in port_names:
                        errs.duplicate(f"{pw}.name", port["name"])
                    port_names.add(port["name"])
                if port.get("protocol") not in PROTOCOLS:
                    errs.unsupported(f"{pw}.protocol", port.get("protocol"), PROTOCOLS)
            for j, mount in enumerate(c.get("volumeMounts") or []):
                if mount.get("name") not in volumes:
                    errs.not_found(f"{where}.volumeMounts[{j}].name", mount.get("name"))
                if not mount.get("mountPath"):
                    errs.required(f"{where}.volumeMounts[{j}].mountPath")
            for probe_key in ("livenessProbe", "readinessProbe", "startupProbe"):
                http = ((c.get(probe_key) or {}).get("httpGet") or {}).get("port")
                if isinstance(http, int):
                    port_number(errs, f"{where}.{probe_key}.httpGet.port", http)
                elif isinstance(http, str) and http not in port_names:
                    port_name(errs, f"{where}.{probe_key}.httpGet.port", http)
    if spec.get("restartPolicy") not in RESTART:
        errs.unsupported(f"{prefix}.restartPolicy", spec.get("restartPolicy"), RESTART)
    elif template and spec["restartPolicy"] != "Always":
        errs.unsupported(f"{prefix}.restartPolicy", spec["restartPolicy"], ("Always",))
    if spec.get("dnsPolicy") not in DNS_POLICIES:
        errs.unsupported(f"{prefix}.dnsPolicy", spec.get("dnsPolicy"), DNS_POLICIES)
    for key in ("hostname", "subdomain"):
        if spec.get(key):
            dns_label(errs, f"{prefix}.{key}", spec[key])
    _pod_quantities(errs, prefix, spec)


def _selector_matches(selector: dict[str, Any], labels_: dict[str, str]) -> bool:
    if not selector.get("matchLabels") and not selector.get("matchExpressions"):
        return False
    if any(labels_.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
        if (op == "In" and labels_.get(key) not in values) or (op == "NotIn" and labels_.get(key) in values) or \
                (op == "Exists" and key not in labels_) or (op == "DoesNotExist" and key in labels_):
            return False
    return True


def _go_selector(selector: dict[str, Any]) -> str:
    pairs = ", ".join(f'"{k}":"{v}"' for k, v in sorted((selector.get("matchLabels") or {}).items()))
    return (f"v1.LabelSelector{{MatchLabels:map[string]string{{{pairs}}}, "
            "MatchExpressions:[]v1.LabelSelectorRequirement(nil)}")


def _validate_workload(errs: Errors, kind: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
    spec = obj.get("spec") or {}
    if isinstance(spec.get("replicas"), int) and spec["replicas"] < 0:
        errs.invalid("spec.replicas", spec["replicas"], "must be greater than or equal to 0")
    selector = spec.get("selector") or {}
    template = spec.get("template") or {}
    tlabels = (template.get("metadata") or {}).get("labels") or {}
    labels(errs, "spec.template.metadata.labels", tlabels)
    if not selector.get("matchLabels") and not selector.get("matchExpressions"):
        errs.invalid_go("spec.selector", _go_selector(selector), "empty selector is invalid for deployment"
                        if kind == "Deployment" else "empty selector is invalid for statefulset")
    elif not _selector_matches(selector, tlabels):
        pairs = ", ".join(f'"{k}":"{v}"' for k, v in sorted(tlabels.items()))
        errs.append(("spec.template.metadata.labels", "FieldValueInvalid",
                     f"Invalid value: map[string]string{{{pairs}}}: `selector` does not match template `labels`"))
    if isinstance(template.get("spec"), dict):
        validate_pod_spec(errs, "spec.template.spec", template["spec"], template=True)
    if kind == "StatefulSet":
        if spec.get("podManagementPolicy") not in ("OrderedReady", "Parallel"):
            errs.unsupported("spec.podManagementPolicy", spec.get("podManagementPolicy"), ("OrderedReady", "Parallel"))
        if (spec.get("updateStrategy") or {}).get("type") not in ("OnDelete", "RollingUpdate"):
            errs.unsupported("spec.updateStrategy.type", (spec.get("updateStrategy") or {}).get("type"),
                             ("OnDelete", "RollingUpdate"))
        if spec.get("serviceName"):
            dns1035(errs, "spec.serviceName", spec["serviceName"])
        for i, claim in enumerate(spec.get("volumeClaimTemplates") or []):
            c_spec = claim.get("spec") or {}
            for key in ("limits", "requests"):
                _canonicalise_map(errs, f"spec.volumeClaimTemplates[{i}].spec.resources.{key}",
                                  (c_spec.get("resources") or {}).get(key))
        if old is not None:
            mutable = ("replicas", "ordinals", "template", "updateStrategy", "persistentVolumeClaimRetentionPolicy",
                       "minReadySeconds")
            before = {k: v for k, v in ((old.get("spec") or {}).items()) if k not in mutable}
            after = {k: v for k, v in spec.items() if k not in mutable}
            if before != after:
                errs.forbidden("spec", "updates to statefulset spec for fields other than 'replicas', 'ordinals', "
                               "'template', 'updateStrategy', 'persistentVolumeClaimRetentionPolicy' and "
                               "'minReadySeconds' are forbidden")
    else:
        if (spec.get("strategy") or {}).get("type") not in ("Recreate", "RollingUpdate"):
            errs.unsupported("spec.strategy.type", (spec.get("strategy") or {}).get("type"),
                             ("Recreate", "RollingUpdate"))
        if old is not None and (old.get("spec") or {}).get("selector") != spec.get("selector"):
            errs.invalid_go("spec.selector", _go_selector(selector), "field is immutable")


SERVICE_TYPES = ("ClusterIP", "ExternalName", "LoadBalancer", "NodePort")


def _validate_service(errs: Errors, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
    spec = obj.get("spec") or {}
    ports = spec.get("ports") or []
    if spec.get("type") not in SERVICE_TYPES:
        errs.unsupported("spec.type", spec.get("type"), SERVICE_TYPES)
    if not ports and spec.get("clusterIP") != "None" and spec.get("type") != "ExternalName":
        errs.required("spec.ports")
    seen: set[str] = set()
    for i, port in enumerate(ports):
        where = f"spec.ports[{i}]"
        name = port.get("name")
        if len(ports) > 1 and not name:
            errs.required(f"{where}.name")
        elif name:
            dns_label(errs, f"{where}.name", name)
            if name in seen:
                errs.duplicate(f"{where}.name", name)
            seen.add(name)
        port_number(errs, f"{where}.port", port.get("port"))
        target = port.get("targetPort")
        if isinstance(target, int):
            port_number(errs, f"{where}.targetPort", target)
        elif isinstance(target, str):
            port_name(errs, f"{where}.targetPort", target)
        if port.get("protocol") not in PROTOCOLS:
            errs.unsupported(f"{where}.protocol", port.get("protocol"), PROTOCOLS)
    if spec.get("sessionAffinity") not in ("ClientIP", "None"):
        errs.unsupported("spec.sessionAffinity", spec.get("sessionAffinity"), ("ClientIP", "None"))
    labels(errs, "spec.selector", spec.get("selector"))
    if old is not None:
        before = (old.get("spec") or {}).get("clusterIP")
        if before and spec.get("clusterIP") != before and spec.get("type") != "ExternalName":
            errs.invalid("spec.clusterIP", spec.get("clusterIP"), "field is immutable")


POD_MUTABLE = ("`spec.containers[*].image`,`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,"
               "`spec.tolerations` (only additions to existing tolerations),`spec.terminationGracePeriodSeconds` "
               "(allow it to be set to 1 if it was previously negative)")


def _validate_pod(errs: Errors, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
    spec = obj.get("spec") or {}
    validate_pod_spec(errs, "spec", spec, template=False)
    if old is not None:
        def fixed(s: dict[str, Any]) -> dict[str, Any]:
            s = copy.deepcopy(s)
            for key in ("activeDeadlineSeconds", "tolerations", "terminationGracePeriodSeconds"):
                s.pop(key, None)
            for group in ("containers", "initContainers"):
                for c in s.get(group) or []:
                    c.pop("image", None)
            return s
        if fixed(old.get("spec") or {}) != fixed(spec):
            errs.forbidden("spec", f"pod updates may not change fields other than {POD_MUTABLE}")


def admit(defaults: Defaults, kind: str, obj: dict[str, Any], old: dict[str, Any] | None,
          strict: bool) -> dict[str, Any]:
    """The object to store for a create (``old`` None) or update of a built-in ``kind``; raises Refused with
    the API server's answer otherwise. Status is not validated (the status subresource writes it)."""
    _, group, _, name_rule = KINDS[kind]
    status = obj.get("status")
    body = {k: v for k, v in obj.items() if k != "status"}
    stored, errs = decode(kind, body, strict)
    if status is not None:
        stored["status"] = status
    if isinstance(obj.get("metadata"), dict):  # the caller's metadata object stays the one stored
        decoded = stored.get("metadata") or {}
        obj["metadata"].clear()
        obj["metadata"].update(decoded)
        stored["metadata"] = obj["metadata"]
    meta = stored.setdefault("metadata", {})
    name = meta.get("name")
    if not name and not meta.get("generateName"):
        errs.required("metadata.name", "name or generateName is required")
    elif name:
        (dns1035 if name_rule == "dns1035" else dns_subdomain)(errs, "metadata.name", name)
    labels(errs, "metadata.labels", meta.get("labels"))
    defaults.apply(kind, stored, old)
    if kind == "Pod":
        _validate_pod(errs, stored, old)
    elif kind == "Service":
        _validate_service(errs, stored, old)
    else:
        _validate_workload(errs, kind, stored, old)
    if errs:
        qualified = f"{kind}.{group}" if group else kind
        text = ", ".join(f"{f}: {m}" for f, _, m in errs)
        message = f'{qualified} "{name or meta.get("generateName", "")}" is invalid: ' + (
            text if len(errs) == 1 else f"[{text}]")
        raise Refused(422, "Invalid", message, {
            "name": name or "", "group": group, "kind": kind,
            "causes": [{"reason": r, "message": m, "field": f} for f, r, m in errs]})
    return stored


def template_hash(template: dict[str, Any]) -> str:
    """A stable short hash of a pod template (the controllers' revision and pod-template-hash labels), in
    the alphabet the Kubernetes controllers use for generated names."""
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).digest()
    alphabet = "bcdfghjklmnpqrstvwxz2456789"
    return "".join(alphabet[b % len(alphabet)] for b in digest[:10])
