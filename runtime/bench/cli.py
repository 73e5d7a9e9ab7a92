"""``grstack bench <name>``: each benchmark prints one JSON object on stdout (progress goes to stderr)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util

# (name, module, help). Each module exposes ``register(parser)`` which sets ``func``.
BENCHES: tuple[tuple[str, str, str], ...] = (
    ("kernels", "grstack.runtime.bench.kernels", "jagged vs padded HSTU attention, forward+backward"),
    ("train", "grstack.runtime.bench.train", "distributed training engine: balancing, pipelining, embeddings"),
    ("simulate", "grstack.runtime.bench.simulate", "modelled scaling to 128-1536 workers (a model, not a measurement)"),
    ("serve", "grstack.runtime.bench.serve", "relay-race ranking: P99 vs length and QPS, relay on/off"),
    ("relay-engine", "grstack.runtime.bench.relay_engine", "the serving engine on one device: prefill, cached and "
                                                           "full ranks, KV arena on/off"),
    ("quality", "grstack.runtime.bench.quality", "train + evaluate a config, report quality and throughput"),
    ("mfu", "grstack.runtime.bench.mfu", "model FLOPs utilisation of training steps on a device"),
)


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH")
    sub.required = True
    for name, module, help_text in BENCHES:
        if importlib.util.find_spec(module) is None:
            continue
        sp = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).register(sp)
