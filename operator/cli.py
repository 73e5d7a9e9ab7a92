"""``grstack operator``: run the Kubernetes operator (kopf) for GRTrainingJob and GRRankingService.

User mistakes (a bad port or URL, a port in use, no way to log in to the API server) end with one
``error:`` line and exit status 2, like the trainer's commands (:class:`grstack.runtime.errors.UserError`).
"""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path
from urllib.parse import urlsplit

from grstack.runtime import cli_args
from grstack.runtime.errors import UserError


def register(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable; globs allowed)")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch the whole cluster (default)")
    parser.add_argument("--liveness-port", type=cli_args.port, default=8080,
                        help="serve /healthz on this port for the liveness probe (0 = off)")
    parser.add_argument("--metrics-port", type=cli_args.port, default=9090,
                        help="Prometheus /metrics port (0 = off)")
    parser.add_argument("--resync-seconds", type=cli_args.positive_float, default=10.0,
                        help="reconcile every resource at least this often")
    parser.add_argument("--server", default=None, type=cli_args.http_url,
                        help="API server URL to use without credentials (e.g. `kubectl proxy`); default: "
                             "in-cluster service account, else kubeconfig")
    parser.add_argument("--peering", default=None, metavar="NAME",
                        help="leader election among replicas through kopf peering: the ClusterKopfPeering (or, "
                             "with --namespace, the KopfPeering in each namespace) named NAME; the live replica "
                             "with the highest --priority works, the others stand by (default: standalone)")
    parser.add_argument("--priority", type=int, default=None,
                        help="peering priority (default: random, so replicas never tie)")
    parser.add_argument("--peering-lifetime-s", type=int, default=60, metavar="S",
                        help="with --peering: a replica that has not renewed its peering entry for S seconds "
                             "counts as dead and a standby takes over (>= 5; default 60)")
    parser.add_argument("--readiness-port", type=cli_args.port, default=0,
                        help="serve /readyz on this port: ready once the CRDs are served (0 = off)")
    parser.add_argument("--allow-privileged-pods", action="store_true",
                        help="accept pod templates that ask for host namespaces, hostPath, privileged or root "
                             "containers, capabilities or another service account (default: refused; chart value "
                             "operator.podSecurity.allowPrivileged)")
    parser.add_argument("--max-replicas", type=int, default=None, metavar="N",
                        help="refuse workers.replicas and serving replicas above N (default and most: the CRDs' "
                             "maximum, 1000; chart value operator.limits.maxReplicas)")
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging, probe requests included")
    parser.set_defaults(func=run)


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad values before kopf starts (it would end them in a traceback or retry forever)."""
    ports = (("--liveness-port", args.liveness_port), ("--metrics-port", args.metrics_port),
             ("--readiness-port", args.readiness_port))
    for flag, port in ports:
        if not 0 <= port <= 65535:
            raise UserError(f"{flag} {port}: not a port number (0-65535; 0 = off)")
    used = [(flag, port) for flag, port in ports if port]
    for i, (flag, port) in enumerate(used):
        for other, port2 in used[i + 1:]:
            if port == port2:
                raise UserError(f"{flag} and {other} are both {port}")
    if args.peering_lifetime_s < 5:
        raise UserError(f"--peering-lifetime-s {args.peering_lifetime_s}: must be >= 5 (replicas renew "
                        "their peering entry a few seconds before it lapses)")
    if not args.resync_seconds > 0:
        raise UserError(f"--resync-seconds {args.resync_seconds}: must be > 0")
    from grstack.operator.names import MAX_REPLICAS

    if args.max_replicas is not None and not 1 <= args.max_replicas <= MAX_REPLICAS:
        raise UserError(f"--max-replicas {args.max_replicas}: must be 1-{MAX_REPLICAS} (the CRDs' maximum)")
    for ns in args.namespace:
        if not ns.strip():
            raise UserError("--namespace: empty namespace name")
    if args.server is not None:
        url = urlsplit(args.server)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise UserError(f"--server {args.server}: not an http(s) URL (e.g. http://127.0.0.1:8001)")
    if args.server is None and not os.environ.get("KUBERNETES_SERVICE_HOST"):
        configs = os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
        if not any(Path(p).is_file() for p in configs.split(os.pathsep) if p):
            raise UserError(f"no way to log in to the Kubernetes API: not in a pod, no kubeconfig ({configs}); "
                            "set KUBECONFIG or give --server URL (e.g. of `kubectl proxy`)")
    for flag, port in ports:
        if port:
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("0.0.0.0", port))
                except OSError as exc:
                    raise UserError(f"{flag} {port}: cannot listen ({exc.strerror or exc})") from exc


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    import kopf

    from grstack.operator.handlers import OperatorConfig, build_registry

    check_args(args)
    from grstack.operator import names, policy

    policy.configure(policy.ClusterPolicy(allow_privileged=args.allow_privileged_pods,
                                          max_replicas=args.max_replicas or names.MAX_REPLICAS))
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # liveness probes every few seconds
    import random

    priority = args.priority if args.priority is not None else random.randint(1, 1 << 30)
    registry, rt = build_registry(OperatorConfig(
        server=args.server, resync_seconds=args.resync_seconds, peering=args.peering, priority=priority,
        peering_lifetime_s=args.peering_lifetime_s, namespaced_peering=bool(args.namespace),
        peering_namespace=(args.namespace or [None])[0],
        readiness_port=args.readiness_port))
    if args.metrics_port:
        try:
            rt.metrics.serve(args.metrics_port)
        except OSError as exc:
            raise UserError(f"--metrics-port {args.metrics_port}: cannot listen ({exc.strerror or exc})") from exc
    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    try:
        asyncio.run(kopf.operator(
            registry=registry,
            standalone=not args.peering,  # without --peering: one replica, no peering objects needed
            peering_name=args.peering,
            priority=priority if args.peering else None,
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            liveness_endpoint=liveness,
        ))
    except kopf.LoginError as exc:
        raise UserError(f"cannot log in to the Kubernetes API ({exc}); give --server URL, a kubeconfig "
                        "(KUBECONFIG) or run in a pod with a service account") from exc
    return 0
