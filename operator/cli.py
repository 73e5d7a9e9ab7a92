"""``grstack operator``: run the Kubernetes operator (kopf) for GRTrainingJob and GRRankingService."""

from __future__ import annotations

import argparse


def register(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable; globs allowed)")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch the whole cluster (default)")
    parser.add_argument("--liveness-port", type=int, default=8080,
                        help="serve /healthz on this port for the liveness probe (0 = off)")
    parser.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port (0 = off)")
    parser.add_argument("--resync-seconds", type=float, default=10.0,
                        help="reconcile every resource at least this often")
    parser.add_argument("--server", default=None,
                        help="API server URL to use without credentials (e.g. `kubectl proxy`); default: "
                             "in-cluster service account, else kubeconfig")
    parser.add_argument("--peering", default=None, metavar="NAME",
                        help="leader election among replicas through kopf peering: the ClusterKopfPeering (or, "
                             "with --namespace, the KopfPeering in each namespace) named NAME; the live replica "
                             "with the highest --priority works, the others stand by (default: standalone)")
    parser.add_argument("--priority", type=int, default=None,
                        help="peering priority (default: random, so replicas never tie)")
    parser.add_argument("--readiness-port", type=int, default=0,
                        help="serve /readyz on this port: ready once the CRDs are served (0 = off)")
    parser.add_argument("--verbose", "-v", action="store_true")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    import kopf

    from grstack.operator.handlers import OperatorConfig, build_registry

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # liveness probes every few seconds
    import random

    priority = args.priority if args.priority is not None else random.randint(1, 1 << 30)
    registry, rt = build_registry(OperatorConfig(
        server=args.server, resync_seconds=args.resync_seconds, peering=args.peering, priority=priority,
        namespaced_peering=bool(args.namespace), peering_namespace=(args.namespace or [None])[0],
        readiness_port=args.readiness_port))
    if args.metrics_port:
        rt.metrics.serve(args.metrics_port)
    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    asyncio.run(kopf.operator(
        registry=registry,
        standalone=not args.peering,  # without --peering: one replica, no peering objects needed
        peering_name=args.peering,
        priority=priority if args.peering else None,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=liveness,
    ))
    return 0
