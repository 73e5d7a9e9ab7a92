"""A small async Kubernetes API client (aiohttp) for the reconcile side effects: get, create, merge-patch,
delete. It authenticates with the same ``kopf.ConnectionInfo`` kopf logged in with, so the operator talks
to exactly one API server with one identity. Only JSON merge patches are sent: idempotent and supported
by every API server (and by the KMock emulator in tests).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import ssl
import tempfile
from typing import Any

import aiohttp

# (apiVersion, kind) -> plural; the operator only touches these kinds.
PLURALS = {
    ("v1", "Pod"): "pods",
    ("v1", "Service"): "services",
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("apps/v1", "StatefulSet"): "statefulsets",
    ("apps/v1", "Deployment"): "deployments",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "horizontalpodautoscalers",
    ("scheduling.x-k8s.io/v1alpha1", "PodGroup"): "podgroups",
    ("scheduling.volcano.sh/v1beta1", "PodGroup"): "podgroups",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("grstack.io/v1alpha1", "GRTrainingJob"): "grtrainingjobs",
    ("grstack.io/v1alpha1", "GRRankingService"): "grrankingservices",
}


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


def path(api_version: str, kind: str, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    plural = PLURALS[(api_version, kind)]
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    out = f"{prefix}/namespaces/{namespace}/{plural}"
    if name:
        out += f"/{name}"
    if subresource:
        out += f"/{subresource}"
    return out


class KubeClient:
    """One aiohttp session per operator; close() on shutdown."""

    def __init__(self, server: str, *, token: str | None = None, ssl_context: ssl.SSLContext | bool | None = None,
                 auth: aiohttp.BasicAuth | None = None, timeout: float = 30.0) -> None:
        self.server = server.rstrip("/")
        self._headers = {"Accept": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        # None: aiohttp's default verification (True), which its request() spells as True
        self._ssl: ssl.SSLContext | bool = True if ssl_context is None else ssl_context
        self._auth = auth
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_connection(cls, info: Any) -> KubeClient:
        """From a ``kopf.ConnectionInfo`` (token, basic auth, client certificates, CA, insecure)."""
        context: ssl.SSLContext | bool | None = None
        if info.server.startswith("https"):
            if info.insecure:
                context = False
            else:
                ca_data = info.ca_data
                if isinstance(ca_data, bytes | str) and ca_data:
                    raw = ca_data.encode() if isinstance(ca_data, str) else ca_data
                    try:
                        pem = base64.b64decode(raw, validate=True).decode()
                    except ValueError:
                        pem = raw.decode()
                    context = ssl.create_default_context(cadata=pem)
                else:
                    context = ssl.create_default_context(cafile=os.fspath(info.ca_path) if info.ca_path else None)
                cert, key = _material(info.certificate_path, info.certificate_data), _material(
                    info.private_key_path, info.private_key_data)
                if cert:
                    context.load_cert_chain(cert, key)
        auth = aiohttp.BasicAuth(info.username, info.password or "") if info.username else None
        return cls(info.server, token=info.token, ssl_context=context, auth=auth)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self._headers, timeout=self._timeout, auth=self._auth)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def request(self, method: str, url_path: str, body: Any = None, *, content_type: str = "application/json",
                      params: dict[str, str] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": content_type} if data is not None else {}
        async with self._client().request(method, self.server + url_path, data=data, headers=headers,
                                          params=params, ssl=self._ssl) as response:
            text = await response.text()
            try:
                payload = json.loads(text) if text else {}
            except ValueError:
                payload = {"message": text}
            if response.status >= 400:
                raise ApiError(response.status, str(payload.get("reason") or response.reason),
                               str(payload.get("message") or text))
            return payload

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", path(api_version, kind, namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, api_version: str, kind: str, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        payload = await self.request("GET", path(api_version, kind, namespace), params={"labelSelector": selector})
        items = payload.get("items") or []
        # Filter here too: some API emulators ignore labelSelector.
        return [i for i in items if all((i.get("metadata", {}).get("labels") or {}).get(k) == v
                                        for k, v in labels.items())]

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return await self.request("POST", path(obj["apiVersion"], obj["kind"], meta["namespace"]), obj)

    async def patch(self, api_version: str, kind: str, namespace: str, name: str, body: dict[str, Any],
                    subresource: str | None = None) -> dict[str, Any]:
        return await self.request("PATCH", path(api_version, kind, namespace, name, subresource), body,
                                  content_type="application/merge-patch+json")

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """True when deleted (or being deleted); False when it was already gone."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        try:
            await self.request("DELETE", path(api_version, kind, namespace, name), body)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True


def _material(file_path: Any, data: Any) -> str | None:
    """A path to PEM material given either as a path or as base64 data (written to a private temp file)."""
    if file_path:
        return os.fspath(file_path)
    if not data:
        return None
    raw = data.encode() if isinstance(data, str) else data
    with contextlib.suppress(ValueError):
        raw = base64.b64decode(raw, validate=True)
    fd, name = tempfile.mkstemp(prefix="grstack-kube-", suffix=".pem")
    with os.fdopen(fd, "wb") as f:
        f.write(raw)
    return name
