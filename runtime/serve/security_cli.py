"""The serving security flags of ``grstack serve ranker|router`` and their validation (see security.py).

Kept apart from security.py so that building the command line imports no aiohttp.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from grstack.runtime.errors import UserError

if TYPE_CHECKING:
    from grstack.runtime.serve.security import ClientSecurity, ServerSecurity

DEFAULT_OPEN_PATHS = ("healthz", "readyz")


def add_security_args(p: argparse.ArgumentParser, client: bool = False) -> None:
    """The serving security flags; ``client``: also those of the router's connections to rankers."""
    g = p.add_argument_group("authentication, TLS and connection limits")
    g.add_argument("--auth-token-file", metavar="PATH",
                   help="require `Authorization: Bearer TOKEN` with one of the tokens in PATH (one a line; re-read "
                        "when it changes, e.g. a mounted Kubernetes Secret)")
    g.add_argument("--open-paths", default=",".join(DEFAULT_OPEN_PATHS), metavar="PATHS",
                   help="comma-separated paths served without token or client certificate (default healthz,readyz; "
                        "add metrics to let Prometheus scrape without a token; '' protects all)")
    g.add_argument("--tls-cert", metavar="PEM", help="serve HTTPS with this certificate (chain) ...")
    g.add_argument("--tls-key", metavar="PEM", help="... and its private key")
    g.add_argument("--tls-client-ca", metavar="PEM",
                   help="require a client certificate signed by this CA on every protected path (mTLS)")
    g.add_argument("--header-timeout-s", type=float, default=5.0,
                   help="a request's headers must arrive within this of its first byte (default 5)")
    g.add_argument("--body-timeout-s", type=float, default=10.0,
                   help="a request's body must arrive within this; else 408 and the connection is closed (default 10)")
    g.add_argument("--idle-timeout-s", type=float, default=60.0,
                   help="an idle keep-alive connection is closed after this (default 60)")
    g.add_argument("--max-connections", type=int, default=4096,
                   help="open connections at most; more are answered 503 and closed (default 4096, at most what "
                        "`ulimit -n` leaves)")
    if client:
        c = p.add_argument_group("the router's connections to rankers")
        c.add_argument("--ranker-token-file", metavar="PATH",
                       help="send the first token in PATH to rankers (rankers started with --auth-token-file)")
        c.add_argument("--ranker-ca", metavar="PEM", help="reach rankers over HTTPS, verified against this CA")
        c.add_argument("--ranker-cert", metavar="PEM", help="client certificate for rankers with --tls-client-ca ...")
        c.add_argument("--ranker-key", metavar="PEM", help="... and its private key")
        c.add_argument("--ranker-server-name", metavar="NAME",
                       help="the name rankers' certificates carry, when they are reached by IP (--rankers-dns)")


def server_security(args: argparse.Namespace) -> ServerSecurity:
    """The validated :class:`ServerSecurity` of ``args`` (a bad file or value is a ``UserError``)."""
    from grstack.runtime.serve.security import ServerSecurity, TokenFile, normalise_paths, server_ssl_context

    for flag in ("header_timeout_s", "body_timeout_s", "idle_timeout_s"):
        value = getattr(args, flag, 1.0)
        if not value > 0 or value == float("inf"):
            raise UserError(f"--{flag.replace('_', '-')} {value:g}: must be a positive number of seconds")
    max_conn = getattr(args, "max_connections", 4096)
    if max_conn < 1:
        raise UserError(f"--max-connections {max_conn}: must be at least 1")
    tls_cert, tls_key, client_ca = (getattr(args, n, None) for n in ("tls_cert", "tls_key", "tls_client_ca"))
    if client_ca and not tls_cert:
        raise UserError("--tls-client-ca needs --tls-cert and --tls-key (client certificates are a TLS feature)")
    ctx = server_ssl_context(tls_cert, tls_key, client_ca) if tls_cert or tls_key else None
    token_file = getattr(args, "auth_token_file", None)
    return ServerSecurity(
        tokens=TokenFile(token_file) if token_file else None,
        open_paths=normalise_paths(getattr(args, "open_paths", ",".join(DEFAULT_OPEN_PATHS)) or ""),
        ssl_context=ctx, client_certs=bool(client_ca),
        header_timeout_s=getattr(args, "header_timeout_s", 5.0), body_timeout_s=getattr(args, "body_timeout_s", 10.0),
        idle_timeout_s=getattr(args, "idle_timeout_s", 60.0), max_connections=max_conn)


def client_security(args: argparse.Namespace) -> ClientSecurity:
    from grstack.runtime.serve.security import ClientSecurity, TokenFile, client_ssl_context

    ca, cert, key = (getattr(args, n, None) for n in ("ranker_ca", "ranker_cert", "ranker_key"))
    if (cert or key) and not ca:
        raise UserError("--ranker-cert/--ranker-key need --ranker-ca (client certificates are a TLS feature)")
    name = getattr(args, "ranker_server_name", None)
    if name and not ca:
        raise UserError("--ranker-server-name needs --ranker-ca")
    token_file = getattr(args, "ranker_token_file", None)
    return ClientSecurity(ssl_context=client_ssl_context(ca, cert, key) if ca else None,
                          token=TokenFile(token_file, "--ranker-token-file") if token_file else None,
                          server_name=name or None)
