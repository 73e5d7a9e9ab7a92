"""Progress reports from rank 0 to the Kubernetes operator, through an annotation on rank 0's own Pod.

The operator gives rank 0 these environment variables (see ``grstack.operator.training``):

- ``GRSTACK_PROGRESS_ANNOTATION``: the annotation key to write (``grstack.io/progress``); unset = disabled;
- ``GRSTACK_POD_NAME`` / ``GRSTACK_POD_NAMESPACE``: the pod's own name and namespace (downward API);
- ``GRSTACK_PROGRESS_INTERVAL``: seconds between two writes at most (default 10).

Why an annotation on the worker's own Pod: the operator watches those pods anyway, so a report reaches the
GRTrainingJob status with no extra watch, no network path from the operator to the workers, and the
least privilege a worker can have: ``patch`` on exactly its own pod (a Role with ``resourceNames``).

The API server is the in-cluster one (``https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`` with
the service-account token and CA); ``GRSTACK_KUBE_API`` names another base URL (tests, out-of-cluster).

``report_progress`` is cheap: with the variables unset it returns at once; otherwise it stores the newest
fields and a background thread sends them (merge patch, throttled; a new checkpoint is sent right away).
Errors never reach training: the first one is logged as a warning, later ones at debug level. At exit the
last report is flushed with a short timeout. The module imports only the standard library.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from typing import Any

log = logging.getLogger("grstack.progress")

ENV_ANNOTATION = "GRSTACK_PROGRESS_ANNOTATION"
ENV_POD = "GRSTACK_POD_NAME"
ENV_NAMESPACE = "GRSTACK_POD_NAMESPACE"
ENV_INTERVAL = "GRSTACK_PROGRESS_INTERVAL"
ENV_API = "GRSTACK_KUBE_API"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
REQUEST_TIMEOUT = 5.0
FLUSH_TIMEOUT = 2.0

_lock = threading.Lock()
_reporters: dict[str, PodAnnotationReporter | None] = {}


def report_progress(fields: dict[str, Any]) -> None:
    """Called by rank 0 after each logged step and each checkpoint; a no-op unless configured."""
    try:
        reporter = _reporter(ENV_ANNOTATION)
        if reporter is not None:
            reporter.submit(fields, urgent="last_checkpoint" in fields or bool(fields.get("finished")))
    except Exception as exc:  # reporting is best effort: never let it stop training
        log.debug("progress report dropped: %s", exc)


def _reporter(env_var: str) -> PodAnnotationReporter | None:
    try:
        return _reporters[env_var]
    except KeyError:
        pass
    with _lock:
        if env_var not in _reporters:
            _reporters[env_var] = PodAnnotationReporter.from_env(env_var)
        return _reporters[env_var]


class PodAnnotationReporter:
    """Keeps the newest report and writes it, merged with earlier fields, to one annotation of one pod."""

    def __init__(self, url: str, annotation: str, interval: float, token_path: str | None,
                 ca_path: str | None) -> None:
        self.url = url
        self.annotation = annotation
        self.interval = interval
        self.token_path = token_path
        self.ca_path = ca_path
        self.sent_count = 0
        self.error_count = 0
        self._state: dict[str, Any] = {}
        self._dirty = False
        self._urgent = False
        self._busy = False  # the background thread holds a report it is sending
        self._last_sent = float("-inf")
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._warned = False
        self._thread: threading.Thread | None = None
        self._ssl = None

    @classmethod
    def from_env(cls, env_var: str) -> PodAnnotationReporter | None:
        annotation = os.environ.get(env_var)
        pod = os.environ.get(ENV_POD)
        namespace = os.environ.get(ENV_NAMESPACE)
        if not (annotation and pod and namespace):
            return None
        base = os.environ.get(ENV_API)
        if not base:
            host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
            if not host:
                log.warning("progress reporting is configured but KUBERNETES_SERVICE_HOST is not set; disabled")
                return None
            host = f"[{host}]" if ":" in host else host
            base = f"https://{host}:{port or 443}"
        try:
            interval = float(os.environ.get(ENV_INTERVAL, "10"))
        except ValueError:
            interval = 10.0
        token = os.path.join(SA_DIR, "token")
        ca = os.path.join(SA_DIR, "ca.crt")
        return cls(
            url=f"{base.rstrip('/')}/api/v1/namespaces/{namespace}/pods/{pod}",
            annotation=annotation,
            interval=max(0.0, interval),
            token_path=token if os.path.exists(token) else None,
            ca_path=ca if os.path.exists(ca) else None,
        )

    def submit(self, fields: dict[str, Any], *, urgent: bool) -> None:
        with self._cond:
            self._state.update(fields)
            self._state["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            self._dirty = True
            self._urgent = self._urgent or urgent
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="grstack-progress", daemon=True)
                self._thread.start()
                atexit.register(self.flush)
            self._cond.notify_all()

    def flush(self, timeout: float = FLUSH_TIMEOUT) -> None:
        """Sends the pending report now (at exit: the final step and summary are not lost).

        Waits (up to ``timeout``) for a report the background thread is sending, so that one is not cut
        off when the process exits either.
        """
        with self._cond:
            self._cond.wait_for(lambda: not self._busy, timeout)
            if not self._dirty:
                return
            payload = self._take()
        self._send(payload, timeout)

    def _take(self) -> bytes:
        self._dirty = self._urgent = False
        self._last_sent = time.monotonic()
        body = {"metadata": {"annotations": {self.annotation: json.dumps(self._state, sort_keys=True, default=str)}}}
        return json.dumps(body).encode()

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._dirty:
                        wait = 0.0 if self._urgent else self._last_sent + self.interval - time.monotonic()
                        if wait <= 0:
                            break
                        self._cond.wait(wait)
                    else:
                        self._cond.wait()
                payload = self._take()
                self._busy = True
            try:
                self._send(payload, REQUEST_TIMEOUT)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _send(self, payload: bytes, timeout: float) -> None:
        with self._send_lock:  # keeps reports in order (the background thread vs the exit flush)
            try:
                self._patch(payload, timeout)
                self.sent_count += 1
            except Exception as exc:  # training must never fail because the API server is unreachable
                self.error_count += 1
                if not self._warned:
                    self._warned = True
                    log.warning("cannot report progress to %s (%s); training continues, later errors are "
                                "logged at debug level", self.url, exc)
                else:
                    log.debug("progress report failed: %s", exc)

    def _patch(self, payload: bytes, timeout: float) -> None:
        import urllib.request

        headers = {"Content-Type": "application/merge-patch+json", "Accept": "application/json"}
        if self.token_path:
            with open(self.token_path, encoding="utf-8") as f:  # re-read: projected tokens rotate
                headers["Authorization"] = f"Bearer {f.read().strip()}"
        request = urllib.request.Request(self.url, data=payload, method="PATCH", headers=headers)
        context = None
        if self.url.startswith("https:"):
            if self._ssl is None:
                import ssl

                self._ssl = ssl.create_default_context(cafile=self.ca_path)
            context = self._ssl
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            response.read()
