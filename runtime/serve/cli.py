"""``grstack serve ranker | router | local``: the relay-race ranking service (see docs/serving.md).

Every server binds 127.0.0.1 unless ``--host`` says otherwise (in a pod: ``--host 0.0.0.0``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from typing import Any

from grstack.runtime import cli_args
from grstack.runtime.cli_args import (
    fraction,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from grstack.runtime.serve.gc_pauses import freeze_startup_heap
from grstack.runtime.serve.schemas import MAX_CANDIDATES
from grstack.runtime.serve.security_cli import add_security_args

MB = 1 << 20


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="serve_command", metavar="ROLE")
    sub.required = True

    r = sub.add_parser("ranker", help="a ranker replica (model + prefix KV cache)",
                       description="Serve an exported HSTU ranking model with a relay (prefix) KV cache.")
    r.add_argument("--checkpoint", required=True, help="exported model.pt, or a run directory holding one")
    _server_args(r, 8081)
    _ranker_args(r)
    r.add_argument("--replica-id", default=None, help="name in the placement store (default: the URL)")
    r.add_argument("--advertise-url", default=None, type=cli_args.http_url,
                   help="URL routers use to reach this replica (default: the listen URL)")
    r.add_argument("--etcd", default=None, metavar="URL", type=cli_args.http_url,
                   help="register in etcd under a lease")
    r.add_argument("--etcd-root", default="/grstack/ranking/default", help="key prefix of this service in etcd")
    _etcd_client_args(r)
    r.add_argument("--lease-ttl-s", type=positive_float, default=5.0,
                   help="seconds the etcd registration outlives this process if it stops renewing it")
    add_security_args(r)
    r.set_defaults(func=run_ranker)

    ro = sub.add_parser("router", help="the router: sequence-aware trigger + affinity routing",
                        description="Route prefill signals and rank requests to ranker replicas.")
    src = ro.add_mutually_exclusive_group(required=True)
    src.add_argument("--rankers", type=cli_args.url_list,
                     help="comma-separated ranker URLs (static replicas, in-memory placements)")
    src.add_argument("--etcd", metavar="URL", type=cli_args.http_url,
                     help="discover replicas and keep placements in etcd")
    src.add_argument("--rankers-dns", metavar="HOST:PORT", type=cli_args.host_port,
                     help="discover replicas as the addresses HOST resolves to (a headless Service of the "
                          "rankers), re-resolved every few seconds; in-memory placements")
    ro.add_argument("--etcd-root", default="/grstack/ranking/default", help="key prefix of this service in etcd")
    _etcd_client_args(ro)
    pl = ro.add_argument_group("placements in the store")
    pl.add_argument("--placement-ttl-s", type=non_negative_float, default=3600.0, metavar="S",
                    help="a stored placement expires this long after its last prefill (0: it lives as long as its "
                         "replica's lease)")
    pl.add_argument("--store-all-placements", action="store_true",
                    help="store every placement, not only those that differ from the user's hash-ring home")
    _server_args(ro, 8080)
    _router_args(ro)
    add_security_args(ro, client=True)
    ro.set_defaults(func=run_router)

    lo = sub.add_parser("local", help="router + N rankers on this machine (the embedded default)",
                        description="Start N ranker processes and a router in one command.")
    lo.add_argument("--checkpoint", required=True, help="exported model.pt, or a run directory holding one")
    lo.add_argument("--replicas", type=positive_int, default=2, help="ranker processes to start")
    _server_args(lo, 8080)
    _ranker_args(lo)
    _router_args(lo)
    lo.set_defaults(func=run_local)


def _etcd_client_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("etcd TLS and auth (with --etcd)")
    g.add_argument("--etcd-ca", metavar="PEM", help="CA bundle that signed etcd's server certificate (turns TLS "
                                                     "on; an https:// URL alone uses the system roots)")
    g.add_argument("--etcd-cert", metavar="PEM", help="client certificate (with --etcd-key)")
    g.add_argument("--etcd-key", metavar="PEM", help="client private key (with --etcd-cert)")
    g.add_argument("--etcd-user", metavar="NAME", help="etcd user (password auth)")
    g.add_argument("--etcd-password-file", metavar="PATH",
                   help="file holding the etcd user's password (default: $GRSTACK_ETCD_PASSWORD)")


def etcd_auth(args: argparse.Namespace) -> Any:
    """The ``EtcdAuth`` of ``args``, validated (a missing file or half-given pair is a ``UserError``)."""
    import os
    from pathlib import Path

    from grstack.runtime.errors import UserError
    from grstack.runtime.serve.etcd_store import PASSWORD_ENV, EtcdAuth

    password = None
    if args.etcd_password_file:
        try:
            password = Path(args.etcd_password_file).read_text().rstrip("\r\n")
        except OSError as exc:
            raise UserError(f"--etcd-password-file {args.etcd_password_file}: {exc.strerror}") from exc
    elif args.etcd_user:
        password = os.environ.get(PASSWORD_ENV)
    auth = EtcdAuth(args.etcd_ca, args.etcd_cert, args.etcd_key, args.etcd_user, password)
    auth.validate()
    return auth


def _server_args(p: argparse.ArgumentParser, port: int) -> None:
    p.add_argument("--host", default="127.0.0.1", type=cli_args.host,
                   help="address to listen on (0.0.0.0: every interface, as in a pod)")
    p.add_argument("--port", type=cli_args.port, default=port, help=f"listen port (default {port}; 0 = any free port)")
    p.add_argument("--log-level", default="INFO", type=cli_args.log_level, metavar="LEVEL",
                   help=f"log level: {', '.join(cli_args.LOG_LEVELS)}")


def _ranker_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("ranker")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] | npu[:N]")
    g.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads per replica (default 1)")
    g.add_argument("--device-cache-mb", type=non_negative_float, default=512, help="device KV cache budget")
    g.add_argument("--dram-cache-mb", type=non_negative_float, default=2048, help="host-DRAM expander budget")
    g.add_argument("--dram-ttl-s", type=non_negative_float, default=600,
                   help="how long evicted prefixes stay in DRAM")
    g.add_argument("--kv-dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="dtype the cached K/V are kept in (default: the model's, exact); bf16 halves a prefix's "
                        "bytes, compute stays in the model's dtype")
    g.add_argument("--eviction", choices=("lru", "cost"), default="lru",
                   help="device-tier eviction: lru, or cost (cheapest to recompute per byte, least recent first)")
    g.add_argument("--max-suffix", type=positive_int, default=None,
                   help="short-term tokens kept per rank (default min(64, max_len/4)); the long-term prefix "
                        "keeps the last max_len - max_suffix")
    g.add_argument("--max-candidates", type=cli_args.int_range(1, MAX_CANDIDATES), default=1024,
                   help=f"most candidates one rank request may carry (1-{MAX_CANDIDATES}, the request schema's cap)")
    g.add_argument("--max-batch", type=positive_int, default=32, help="rank requests per compute step")
    g.add_argument("--chunk", type=positive_int, default=256, help="misses with histories up to this many tokens are ranked by one full inference; "
                        "longer ones and prefills go through steps of --max-step-tokens")
    g.add_argument("--max-step-tokens", type=positive_int, default=1024,
                   help="new prefix tokens of one batched prefill/miss step, given out first come first served "
                        "(bounds a rank's wait behind it)")
    g.add_argument("--prefill-wait-ms", type=non_negative_float, default=200,
                   help="unused (a rank now joins its in-flight prefill); kept for old command lines")
    g.add_argument("--max-queue", type=non_negative_int, default=256,
                   help="queued rank requests per ranker; beyond it 503 + Retry-After (0 = unbounded)")
    g.add_argument("--max-prefill-queue", type=non_negative_int, default=1024,
                   help="queued prefills per ranker; beyond it 503 + Retry-After (0 = unbounded)")
    g.add_argument("--no-cache-misses", dest="cache_misses", action="store_false",
                   help="drop the prefix K/V a rank miss computed (default: cache it for the user's next visits)")
    g.add_argument("--admission-margin-ms", type=cli_args.float_range(), default=5.0,
                   help="a rank predicted (queued work ahead, measured compute speed) to finish later than its "
                        "deadline minus this is answered 503 at once (negative = no prediction)")


def _router_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("router")
    g.add_argument("--slo-ms", type=positive_float, default=50.0, help="P99 latency budget of a rank request")
    g.add_argument("--risk-fraction", type=fraction, default=0.5,
                   help="a prefix is at risk when predicted full inference exceeds this fraction of the SLO")
    g.add_argument("--length-threshold", type=positive_int, default=None,
                   help="admit prefixes of at least this many tokens (overrides the latency model)")
    g.add_argument("--cache-budget-mb", type=non_negative_float, default=1024, help="footprint of admitted prefixes")
    g.add_argument("--cache-budget-per-replica-mb", type=non_negative_float, default=None,
                   help="footprint of admitted prefixes per up replica (overrides --cache-budget-mb; follows "
                        "the replica count)")
    g.add_argument("--footprint-ttl-s", type=positive_float, default=600,
                   help="how long an admitted prefix counts against the cache budget after its last use")
    g.add_argument("--prefill-budget-ms", type=non_negative_float, default=500,
                   help="predicted pre-infer compute admitted per replica per second (averaged over 10 s)")
    g.add_argument("--load-poll-interval-s", type=non_negative_float, default=1.0,
                   help="how often the router reads each ranker's load (/v1/stats) for the per-ranker budgets "
                        "and the load cap (0 = never: router-wide budgets)")
    g.add_argument("--overload-min-load", type=positive_int, default=4,
                   help="a placed user moves off its replica when that replica's load (in flight or queued) is "
                        "at least this and above the ring's load factor x the mean")
    g.add_argument("--ranker-cache-fraction", type=fraction, default=0.8,
                   help="share of each ranker's reported cache capacity this router may fill with admitted "
                        "prefixes")
    g.add_argument("--no-relay", action="store_true", help="ignore prefill signals (full inference only)")
    g.add_argument("--rank-timeout-ms", type=positive_float, default=2000, help="timeout of one rank attempt")
    g.add_argument("--rank-budget-ms", type=positive_float, default=None,
                   help="deadline budget of a rank, sent to the ranker as X-Grstack-Deadline-Ms (default: the "
                        "rank timeout); work past it is dropped and answered 504")
    g.add_argument("--retry-budget-ratio", type=non_negative_float, default=0.1,
                   help="retries allowed as a fraction of requests over 10 s (plus 3)")
    g.add_argument("--outlier-failures", type=positive_int, default=5,
                   help="consecutive 5xx/timeouts that eject a replica (outlier detection)")
    g.add_argument("--outlier-ejection-s", type=non_negative_float, default=5.0,
                   help="base ejection time; x the replica's recent ejection count, at most 60 s")
    g.add_argument("--outlier-latency-min-hosts", type=cli_args.int_range(2), default=5,
                   help="look for latency outliers only among this many replicas or more (default 5, as Envoy)")


def ranker_config(args: argparse.Namespace, max_len: int) -> Any:
    from grstack.runtime.device import resolve_device
    from grstack.runtime.errors import UserError
    from grstack.runtime.serve.ranker import RankerConfig

    max_suffix = args.max_suffix if args.max_suffix is not None else max(1, min(64, max_len // 4))
    if not 0 < max_suffix < max_len:
        raise UserError(f"--max-suffix {max_suffix}: must be between 1 and the model's max_len - 1 "
                        f"({max_len - 1})")
    for name in ("max_candidates", "max_batch", "chunk", "threads", "max_step_tokens"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    return RankerConfig(replica_id=getattr(args, "replica_id", None), device=str(resolve_device(args.device)),
                        device_cache_bytes=int(args.device_cache_mb * MB), dram_cache_bytes=int(args.dram_cache_mb * MB),
                        dram_ttl_s=args.dram_ttl_s, max_suffix=max_suffix, max_candidates=args.max_candidates,
                        max_batch=args.max_batch, chunk=args.chunk, prefill_wait_ms=args.prefill_wait_ms,
                        max_queue=getattr(args, "max_queue", 256) or None,
                        max_prefill_queue=getattr(args, "max_prefill_queue", 1024) or None,
                        max_step_tokens=args.max_step_tokens,
                        admission_margin_ms=_margin(getattr(args, "admission_margin_ms", 5.0)),
                        cache_misses=getattr(args, "cache_misses", True),
                        lease_ttl_s=getattr(args, "lease_ttl_s", 5.0), num_threads=args.threads,
                        kv_dtype=getattr(args, "kv_dtype", None), eviction=getattr(args, "eviction", "lru"))


def ranker_config_from_flags(flags: list[str], max_len: int) -> Any:
    """The configuration ``grstack serve ranker`` builds from ``flags`` (its ranker flags; others are ignored):
    a simulated ranker is configured by the very command line a real one is given."""
    p = argparse.ArgumentParser()
    _ranker_args(p)
    args, _ = p.parse_known_args(flags)
    return ranker_config(args, max_len)


def _margin(ms: float) -> float | None:
    return None if ms < 0 else ms


def ranker_flags(args: argparse.Namespace) -> list[str]:
    """The ranker options of ``args`` as command-line flags (for ``local``'s child processes)."""
    out = ["--device", args.device, "--threads", str(args.threads), "--device-cache-mb", str(args.device_cache_mb),
           "--dram-cache-mb", str(args.dram_cache_mb), "--dram-ttl-s", str(args.dram_ttl_s),
           "--max-candidates", str(args.max_candidates), "--max-batch", str(args.max_batch),
           "--chunk", str(args.chunk), "--max-step-tokens", str(args.max_step_tokens),
           "--prefill-wait-ms", str(args.prefill_wait_ms),
           "--max-queue", str(getattr(args, "max_queue", 256)),
           "--max-prefill-queue", str(getattr(args, "max_prefill_queue", 1024)),
           "--admission-margin-ms", str(getattr(args, "admission_margin_ms", 5.0)),
           *([] if getattr(args, "cache_misses", True) else ["--no-cache-misses"]),
           "--log-level", args.log_level]
    if args.max_suffix is not None:
        out += ["--max-suffix", str(args.max_suffix)]
    if getattr(args, "kv_dtype", None) is not None:
        out += ["--kv-dtype", args.kv_dtype]
    if getattr(args, "eviction", "lru") != "lru":
        out += ["--eviction", args.eviction]
    return out


def router_config(args: argparse.Namespace, rankers: tuple[str, ...] = ()) -> Any:
    from grstack.runtime.errors import UserError
    from grstack.runtime.serve.router import RouterConfig
    from grstack.runtime.serve.trigger import TriggerConfig

    if args.slo_ms <= 0 or not 0 < args.risk_fraction <= 1:
        raise UserError("--slo-ms must be positive and --risk-fraction in (0, 1]")
    poll = getattr(args, "load_poll_interval_s", 1.0)
    fraction = getattr(args, "ranker_cache_fraction", 0.8)
    min_load = getattr(args, "overload_min_load", 4)
    if poll < 0:
        raise UserError(f"--load-poll-interval-s {poll:g}: must be 0 (no polling) or a number of seconds")
    if not 0 < fraction <= 1:
        raise UserError(f"--ranker-cache-fraction {fraction:g}: must be in (0, 1]")
    if min_load < 1:
        raise UserError(f"--overload-min-load {min_load}: must be at least 1")
    min_hosts = getattr(args, "outlier_latency_min_hosts", 5)
    if min_hosts < 2:
        raise UserError(f"--outlier-latency-min-hosts {min_hosts}: must be at least 2 (an outlier is one replica "
                        f"against the others)")
    trig = TriggerConfig(slo_ms=args.slo_ms, risk_fraction=args.risk_fraction,
                         length_threshold=args.length_threshold,
                         cache_budget_bytes=int(args.cache_budget_mb * MB), footprint_ttl_s=args.footprint_ttl_s,
                         ranker_cache_fraction=fraction)
    per_replica = getattr(args, "cache_budget_per_replica_mb", None)
    dns = getattr(args, "rankers_dns", None)
    if dns is not None and (dns.rpartition(":")[0] == "" or not dns.rpartition(":")[2].isdigit()):
        raise UserError(f"--rankers-dns {dns}: expected HOST:PORT")
    ttl = getattr(args, "placement_ttl_s", 3600.0)
    if ttl < 0:
        raise UserError(f"--placement-ttl-s {ttl:g}: must be 0 (no expiry) or a number of seconds")
    return RouterConfig(rankers=rankers, rankers_dns=dns, relay=not args.no_relay, trigger=trig,
                        placement_ttl_s=ttl or None,
                        placement_exceptions_only=not getattr(args, "store_all_placements", False),
                        cache_budget_per_replica_bytes=None if per_replica is None else int(per_replica * MB),
                        prefill_budget_per_replica_ms=args.prefill_budget_ms,
                        load_poll_interval_s=poll, overload_min_load=min_load,
                        rank_timeout_s=args.rank_timeout_ms / 1e3,
                        rank_budget_ms=getattr(args, "rank_budget_ms", None),
                        retry_budget_ratio=getattr(args, "retry_budget_ratio", 0.1),
                        outlier_consecutive_failures=getattr(args, "outlier_failures", 5),
                        outlier_base_ejection_s=getattr(args, "outlier_ejection_s", 5.0),
                        outlier_latency_min_hosts=min_hosts)


def _run_server(main: Any, args: argparse.Namespace) -> None:
    """Runs a server's ``main``; a port taken between the start-up check and the bind is a UserError too."""
    import errno

    from grstack.runtime.errors import UserError

    try:
        asyncio.run(main())
    except OSError as exc:
        if exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
            raise
        raise UserError(f"--port {args.port}: cannot listen on {args.host}:{args.port} "
                        f"({exc.strerror or exc})") from None


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


async def _serve_until_signal(stop_cb: Any) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await stop_cb()


def run_ranker(args: argparse.Namespace) -> int:
    from grstack.runtime.serve.artifact import load_serving_model
    from grstack.runtime.serve.clock import SystemClock
    from grstack.runtime.serve.ranker import RankerService, start_ranker
    from grstack.runtime.serve.security_cli import server_security

    _logging(args.log_level)
    cli_args.check_bindable(args.host, args.port)  # in use, or not this machine's: one line, before any work
    auth = etcd_auth(args) if args.etcd else None  # a bad TLS/auth option fails before the model loads
    security = server_security(args)
    model, tasks, user_vocab = load_serving_model(args.checkpoint)
    cfg = ranker_config(args, int(model.max_len))

    async def main() -> None:
        store = None
        if args.etcd:
            from grstack.runtime.serve.etcd_store import EtcdPlacementStore

            store = EtcdPlacementStore(args.etcd, args.etcd_root, auth=auth)
        service = RankerService(model, tasks, cfg, store=store, user_vocab=user_vocab, clock=SystemClock())
        from grstack.runtime.serve.http import start_site
        from grstack.runtime.serve.ranker import make_ranker_app

        if args.advertise_url:
            runner, _ = await start_site(make_ranker_app(service, security), args.host, args.port, security)
            await service.start(args.advertise_url)
            url = args.advertise_url
        else:
            runner, url = await start_ranker(service, args.host, args.port, security)
        freeze_startup_heap()  # this process is the ranker's: its startup heap stays out of later collections
        print(json.dumps({"event": "ready", "url": url, "replica": service.replica_id}), flush=True)

        async def stop() -> None:
            await runner.cleanup()
            if args.advertise_url:
                await service.stop()

        await _serve_until_signal(stop)

    _run_server(main, args)
    return 0


def run_router(args: argparse.Namespace) -> int:
    from grstack.runtime.serve.clock import SystemClock
    from grstack.runtime.serve.router import Router, start_router
    from grstack.runtime.serve.security_cli import client_security, server_security
    from grstack.runtime.serve.transport import HttpTransport

    _logging(args.log_level)
    cli_args.check_bindable(args.host, args.port)  # in use, or not this machine's: one line, before any work
    rankers = tuple(u.strip().rstrip("/") for u in (args.rankers or "").split(",") if u.strip())
    cfg = router_config(args, rankers)
    auth = etcd_auth(args) if args.etcd else None
    security, client = server_security(args), client_security(args)

    async def main() -> None:
        store = None
        if args.etcd:
            from grstack.runtime.serve.etcd_store import EtcdPlacementStore

            store = EtcdPlacementStore(args.etcd, args.etcd_root, auth=auth)
        router = Router(cfg, store, client, transport=HttpTransport(client), clock=SystemClock())
        try:
            runner, url = await start_router(router, args.host, args.port, security)
        except BaseException:
            await router.stop()  # its client session too: no "Unclosed connector" after the error line
            raise
        freeze_startup_heap()
        print(json.dumps({"event": "ready", "url": url, "replicas": router.up_replicas()}), flush=True)
        await _serve_until_signal(runner.cleanup)

    _run_server(main, args)
    return 0


def run_local(args: argparse.Namespace) -> int:
    from grstack.runtime.errors import UserError
    from grstack.runtime.model import resolve_model_file
    from grstack.runtime.serve.local import LocalCluster

    _logging(args.log_level)
    cli_args.check_bindable(args.host, args.port)  # in use, or not this machine's: one line, before any work
    if args.replicas < 1:
        raise UserError("--replicas must be at least 1")
    checkpoint = resolve_model_file(args.checkpoint)
    cfg = router_config(args)

    async def main() -> None:
        cluster = LocalCluster(checkpoint, args.replicas, ranker_flags(args), cfg, host=args.host, port=args.port)
        await cluster.start()
        freeze_startup_heap()
        print(json.dumps({"event": "ready", "url": cluster.url, "rankers": [r.url for r in cluster.rankers]}),
              flush=True)
        print(f"router at {cluster.url} with {args.replicas} ranker(s); POST /v1/prefill and /v1/rank, API at "
              f"{cluster.url}/openapi.json; Ctrl-C stops", file=sys.stderr)
        await _serve_until_signal(cluster.stop)

    _run_server(main, args)
    return 0
