"""``grstack bench simulate``: a MODEL, not a measurement — the engine's step time and weak-scaling efficiency
at 128-1,536 workers, extrapolated from the collectives the engine itself issues (docs/simulate.md).

1. A small real job runs the engine (``harness.run_modes`` on ``--nproc`` gloo ranks, sparse groups of
   ``--log-group``, so both the sparse group's All2Alls and the replica sync happen; dual-buffer prefetch and
   ``--microbatches`` frozen-window micro-batches on) with ``embedding.CommLog`` on: every collective, with its
   op, group, bytes, dtype, issuing thread and whether it was async. Without ``--quick`` the job reads the
   target config's data and batches (``--config``: the 27k preset, 21,504 tokens per rank) with a narrow
   model (the collectives' sequence does not depend on the width; their bytes are scaled to it below).
2. Each steady step's events (not the first: its lookup is not prefetched; not the last: nothing to
   prefetch) are replayed at W workers, every event with its bytes scaled to the target (``scale_bytes``)
   and an alpha-beta time (``NetworkModel``), with the overlap the engine has, read from the log (which
   thread issued it, async or not, where the main thread waited): the prefetch thread's lookup of the next
   batch runs beside the whole step; the communication thread runs its rows / gradient All2Alls in FIFO
   order while the main thread computes micro-batch by micro-batch and waits for each micro-batch's rows
   and, at the end, for every gradient send; main-thread collectives block it; the async dense all-reduce
   runs from its launch until the logged ``wait``.
3. Compute per micro-batch: its model FLOPs for the target model (``bench.mfu`` counting, on the logged
   run's own batches) / (peak x MFU). Host work (batch preparation, the sparse optimizer, index ops) is
   not modelled.

Weak scaling: every worker keeps its batch. Per-rank keys, rows and gradients stay as logged; the routing
counts grow with the group (G x units x 2 int64); the replica sync moves the union of the rows that all
replicas touched in a shard, which grows with the replica count: ``UnionModel`` estimates it from the data's
item distribution (fitted to the logged key sets at one rank-batch, checked against their unions of 2..n).
efficiency(W) = step(smallest W) / step(W). ``--sensitivity``: each assumption x2 and /2.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

PUBLISHED = {"scaling_efficiency": 0.9407, "workers": 1536,
             "source": "NestPipe (nested pipelining), measured at 1,536 workers"}
DEFAULT_CONFIG = "configs/kuairand-27k-hstu-large.yaml"
COMM_THREAD, PREFETCH_THREAD = "grstack-comm", "grstack-prefetch"


def register(parser: argparse.ArgumentParser) -> None:
    from grstack.runtime import cli_args as ca

    parser.add_argument("--quick", action="store_true", help="log a tiny-data job (a test of the path)")
    parser.add_argument("--json", action="store_true", help="accepted for symmetry: the output is always JSON")
    parser.add_argument("--config", default=DEFAULT_CONFIG, type=ca.config_file, help="the target: its model (and, without "
                        "--quick, its data and batches for the logged run)")
    parser.add_argument("--workers", default="128,256,512,1024,1536", type=ca.positive_int_list,
                        help="comma-separated worker counts to model")
    parser.add_argument("--nproc", type=ca.positive_int, default=4, help="ranks of the logged run")
    parser.add_argument("--log-group", type=ca.positive_int, default=2, help="sparse group size of the logged run")
    parser.add_argument("--steps", type=ca.positive_int, default=None,
                        help="logged steps (default 5; 4 without --quick)")
    parser.add_argument("--microbatches", type=ca.positive_int, default=4, help="micro-batches per batch")
    parser.add_argument("--devices-per-node", type=ca.positive_int, default=8, help="accelerators per node")
    parser.add_argument("--sparse-group", type=ca.positive_int, default=8,
                        help="target HSP group size (default: a node)")
    parser.add_argument("--peak-tflops", type=ca.positive_float, default=989.4,
                        help="accelerator peak (H200 bf16 dense)")
    parser.add_argument("--mfu", type=ca.fraction, default=0.4, help="achieved fraction of peak for the model FLOPs")
    parser.add_argument("--intra-gbps", type=ca.positive_float, default=300.0,
                        help="intra-node GB/s per device, achieved")
    parser.add_argument("--inter-gbps", type=ca.positive_float, default=40.0,
                        help="inter-node GB/s per device, achieved")
    parser.add_argument("--intra-latency-us", type=ca.non_negative_float, default=5.0, help="per message, intra-node")
    parser.add_argument("--inter-latency-us", type=ca.non_negative_float, default=15.0, help="per message, inter-node")
    parser.add_argument("--host-gbps", type=ca.positive_float, default=10.0,
                        help="host metadata (gloo/TCP) GB/s per rank")
    parser.add_argument("--host-latency-us", type=ca.non_negative_float, default=30.0, help="per gloo/TCP message")
    parser.add_argument("--save-log", default=None, type=ca.output_file,
                        help="write the logged run (events, batch stats) here")
    parser.add_argument("--from-log", default=None, type=ca.input_file,
                        help="simulate a log written by --save-log (no run)")
    parser.set_defaults(func=run)


def _log(msg: str) -> None:
    print(f"[bench simulate] {msg}", file=sys.stderr, flush=True)


# -- the network model ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NetworkModel:
    devices_per_node: int = 8
    intra_gbps: float = 300.0
    inter_gbps: float = 40.0
    intra_latency_us: float = 5.0
    inter_latency_us: float = 15.0
    host_gbps: float = 10.0
    host_latency_us: float = 30.0

    def host(self) -> NetworkModel:
        """The link of host (gloo, TCP) collectives: routing metadata, keys, sizes (``Comm.meta``)."""
        return replace(self, intra_gbps=self.host_gbps, inter_gbps=self.host_gbps,
                       intra_latency_us=self.host_latency_us, inter_latency_us=self.host_latency_us)

    def link(self, inter: bool) -> tuple[float, float]:
        """(alpha seconds, beta bytes/s) of one link."""
        if inter:
            return self.inter_latency_us * 1e-6, self.inter_gbps * 1e9
        return self.intra_latency_us * 1e-6, self.intra_gbps * 1e9

    def all_to_all(self, members: int, per_node: int, nbytes: float) -> float:
        """Each member sends nbytes/members to every other member, all at once; intra- and inter-node peers
        progress in parallel on their own links: max over the two of peers x alpha + their bytes / beta."""
        if members <= 1:
            return 0.0
        piece = nbytes / members
        local, remote = min(per_node, members) - 1, members - min(per_node, members)
        (ai, bi), (ae, be) = self.link(False), self.link(True)
        return max(local * (ai + piece / bi), remote * (ae + piece / be))

    @staticmethod
    def _flat_all_reduce(members: int, nbytes: float, alpha: float, beta: float) -> float:
        """min(ring, double binary tree): ring 2(N-1)a + 2(N-1)/N n/b; tree 2 ceil(log2 N) a + 2 n/b."""
        if members <= 1:
            return 0.0
        ring = 2 * (members - 1) * alpha + 2 * (members - 1) / members * nbytes / beta
        tree = 2 * math.ceil(math.log2(members)) * alpha + 2 * nbytes / beta
        return min(ring, tree)

    def all_reduce(self, members: int, per_node: int, nbytes: float) -> float:
        """Flat on one node or one member per node; otherwise hierarchical: intra-node reduce-scatter, the
        inter-node all-reduce of 1/p of the bytes across members/p nodes (each device on its own NIC),
        intra-node all-gather."""
        p = min(per_node, members)
        if p >= members:
            return self._flat_all_reduce(members, nbytes, *self.link(False))
        if p <= 1:
            return self._flat_all_reduce(members, nbytes, *self.link(True))
        ai, bi = self.link(False)
        intra = 2 * (p - 1) * (ai + nbytes / p / bi)
        return intra + self._flat_all_reduce(members // p, nbytes / p, *self.link(True))

    def all_gather(self, members: int, per_node: int, piece: float) -> float:
        """Ring: (N-1) x (alpha + piece / beta), on the inter-node link when the members span nodes."""
        if members <= 1:
            return 0.0
        alpha, beta = self.link(min(per_node, members) < members)
        return (members - 1) * (alpha + piece / beta)

    def barrier(self, members: int, per_node: int) -> float:
        return self._flat_all_reduce(members, 0.0, *self.link(min(per_node, members) < members))

    def formulas(self) -> dict[str, str]:
        return {
            "all_to_all": "max(local_peers x (a_intra + B/G / b_intra), remote_peers x (a_inter + B/G / b_inter));"
                          " B = bytes this rank sends (to every member, itself included), G members, "
                          "local_peers = min(G, devices_per_node) - 1, remote_peers = G - min(G, devices_per_node)",
            "all_reduce": "one node or one member per node: min(ring 2(N-1)a + 2(N-1)/N B/b, tree 2 ceil(log2 N) a +"
                          " 2 B/b); else hierarchical with p members per node: 2(p-1)(a_intra + B/p / b_intra) + "
                          "the flat inter-node all-reduce of B/p over N/p nodes",
            "all_gather": "(N-1)(a + piece/b), inter-node link when the members span nodes",
            "members": "sparse groups: G consecutive ranks (min(G, devices_per_node) per node); replica groups: "
                       "W/G ranks of stride G (devices_per_node/G per node when G < devices_per_node, else 1); "
                       "world: W",
            "host": "integer (host metadata) collectives travel on the gloo twin (Comm.meta, TCP): every "
                      "formula with a_host, b_host for intra- and inter-node peers alike",
            "contention": "none: concurrent collectives (prefetch thread, communication thread, main thread) "
                          "each get the full link",
        }


# -- the union of touched rows ----------------------------------------------------------------------------------
class UnionModel:
    """Expected distinct ids U(n) in n rank-batches: item i is in one rank-batch with probability
    q_i = 1 - (1 - p_i)^k (1 - 1/N)^m — p_i its share of the data's events, m the uniform negatives a
    rank-batch draws, k the sequence ids it draws, fitted so that U(1) equals the logged mean keys per
    rank-batch (sequences are not independent draws: the fit absorbs that) — and U(n) = sum_i 1 - (1-q_i)^n."""

    def __init__(self, item_counts: Any, keys_per_batch: float, negatives: float) -> None:
        import numpy as np

        counts = np.asarray(item_counts, dtype=np.float64)
        self.num_items = counts.size
        self.p = counts / counts.sum()
        self.negatives = float(negatives)
        self.keys_per_batch = float(keys_per_batch)
        lo, hi = 0.0, 1e9
        for _ in range(200):
            mid = (lo + hi) / 2
            if self._u(1, mid) < keys_per_batch:
                lo = mid
            else:
                hi = mid
        self.k = (lo + hi) / 2

    def _miss(self, k: float) -> Any:
        import numpy as np

        log_miss = k * np.log1p(-np.minimum(self.p, 1 - 1e-12)) + self.negatives * math.log1p(-1 / self.num_items)
        return np.exp(log_miss)  # probability that an item is NOT in one rank-batch

    def _u(self, n: float, k: float) -> float:

        return float((1 - self._miss(k) ** n).sum()) if self.num_items else 0.0

    def __call__(self, n: float) -> float:
        return self._u(n, self.k)

    @staticmethod
    def measured(key_sets: list[Any], orders: int = 8) -> list[float]:
        """Mean distinct ids in the union of the first n of ``key_sets``, over a few random orders."""
        import numpy as np

        rng = np.random.default_rng(0)
        sums = np.zeros(len(key_sets))
        for _ in range(orders):
            seen: set[int] = set()
            for j, i in enumerate(rng.permutation(len(key_sets))):
                seen.update(int(x) for x in key_sets[i])
                sums[j] += len(seen)
        return (sums / orders).tolist()


# -- scaling each logged event to the target ---------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    workers: int
    sparse_group: int
    d_model: int
    dense_params: int


@dataclass(frozen=True)
class Logged:
    ranks: int
    sparse_group: int
    d_model: int
    table_rows: int = 0  # rows of the item table (items + the padding row): a shard's presence mask


def union_events_at(main: list[dict[str, Any]], t: Target, lg: Logged, union: Callable[[float], float],
                    union_scale: float = 1.0) -> list[dict[str, Any]]:
    """The main thread's events with the replica union agreed the way the engine would at the target
    (``ShardedEmbedding.reduce_replicas``): one all-reduce of the largest key count, then either the keys
    all-gathered (padded to that count) or a presence mask of the shard's rows max-reduced, by the engine's
    own rule (``embedding.union_by_mask``) on the target's replica count, keys and shard rows. The keys per
    replica scale like the logged gathered keys (U(G)/G); the mask is ceil(table_rows / G) bytes. Returned
    events carry their target bytes (``target_bytes``)."""
    from grstack.runtime.embedding import union_by_mask

    idx = [i for i, e in enumerate(main) if e["group"].startswith("replica")
           and not e["dtype"].startswith(("float", "bfloat")) and e["op"] != "wait"]
    if not idx or not lg.table_rows:
        return main
    gathered = [main[i]["nbytes"] for i in idx if main[i]["op"] in ("all_gather", "all_gather_v")]
    # keys per replica as logged, or (a logged run that agreed by the mask) from the union model
    logged_keys = max(gathered) / 8 if gathered else union(lg.sparse_group) / lg.sparse_group
    keys = logged_keys * union(t.sparse_group) / t.sparse_group / (union(lg.sparse_group) / lg.sparse_group)
    keys *= union_scale
    replicas, shard_rows = t.workers // t.sparse_group, -(-lg.table_rows // t.sparse_group)
    first = main[idx[0]]
    count = {**first, "op": "all_reduce", "dtype": "int64", "nbytes": 8, "async_op": False, "target_bytes": 8.0}
    if union_by_mask(replicas, math.ceil(keys), shard_rows):
        agree = {**first, "op": "all_reduce", "dtype": "uint8", "nbytes": shard_rows, "async_op": False,
                 "target_bytes": float(shard_rows)}
    else:
        agree = {**first, "op": "all_gather", "dtype": "int64", "nbytes": int(8 * keys), "async_op": False,
                 "target_bytes": 8.0 * keys}
    return main[: idx[0]] + [count, agree] + [e for i, e in enumerate(main) if i > idx[0] and i not in idx]


def members(group: str, W: int, G: int, per_node: int) -> tuple[int, int]:
    """(members, members per node) of a group of the target job."""
    if group.startswith("sparse"):
        return G, min(G, per_node)
    if group.startswith("replica"):
        return W // G, max(1, per_node // G) if per_node > G else 1
    return W, min(per_node, W)


def scale_bytes(e: dict[str, Any], t: Target, lg: Logged, union: Callable[[float], float],
                union_scale: float = 1.0) -> float:
    """The bytes of a logged event at the target (``nbytes``: this rank's input; all-gathers: its piece).

    * sparse groups: routing counts ([G, units, 2] int64) grow with G; keys stay per rank; rows and gradients
      (float) scale with the width d; the clipping norm stays 4 B;
    * replica groups: the union's agreement (count, keys or mask) is rebuilt at the target by
      ``union_events_at`` (events carrying ``target_bytes``); logged sizes stay 8 B per member and gathered
      keys (this shard's rows of one group's batch) scale with U(G)/G; the all-reduced rows (the union over replicas of one shard's touched rows) with
      U(W)/G and d (x ``union_scale``, the sensitivity knob);
    * world: the dense buckets are the target's dense gradient, the stats all-reduce 4 + W floats (fp32).
    """
    if "target_bytes" in e:  # already at the target (union_events_at)
        return float(e["target_bytes"])
    op, group, n = e["op"], e["group"], float(e["nbytes"])
    floating = e["dtype"].startswith(("float", "bfloat"))
    W, G = t.workers, t.sparse_group
    if group.startswith("sparse"):
        if op == "exchange":
            return n * G / lg.sparse_group
        if op == "all_to_all" and floating:
            return n * t.d_model / lg.d_model
        return n
    if group.startswith("replica"):
        if op == "all_gather_v":
            return n * union(G) / G / (union(lg.sparse_group) / lg.sparse_group) * union_scale
        if op == "all_reduce":
            logged = union(lg.ranks) / lg.sparse_group
            return n * (union(W) / G) / logged * t.d_model / lg.d_model * union_scale
        return n
    if op == "all_reduce":  # the stats (4 + ranks floats), or a bucket of the dense gradient
        if not e["async_op"] or n <= 4.0 * (4 + lg.ranks):
            return 4.0 * (4 + W)
        return 4.0 * t.dense_params  # the logged model's dense gradient fits one bucket
    return n


def event_seconds(e: dict[str, Any], nbytes: float, t: Target, net: NetworkModel) -> float:
    if e["dtype"].startswith(("int", "uint")):
        net = net.host()
    N, p = members(e["group"], t.workers, t.sparse_group, net.devices_per_node)
    op = e["op"]
    if op in ("all_to_all", "exchange"):
        return net.all_to_all(N, p, nbytes)
    if op == "all_reduce":
        return net.all_reduce(N, p, nbytes)
    if op in ("all_gather", "all_gather_v", "all_gather_sizes"):
        return net.all_gather(N, p, nbytes)
    if op == "wait":
        return 0.0
    return net.barrier(N, p)


# -- replaying one step ------------------------------------------------------------------------------------------
def comm_tasks(stats: dict[str, Any]) -> list[tuple[str, int]]:
    """The communication thread's tasks of a step, in the order the engine submits them (``Engine.step``):
    the shared negatives' rows and micro-batch 0's rows first; before computing micro-batch m, the rows of
    m+1; after it, m's gradients; after the loop, the negatives' gradients."""
    mb_units, neg = stats["mb_units"], stats["neg_unit"]
    tasks: list[tuple[str, int]] = [("rows", neg)] if neg is not None else []
    tasks.append(("rows", mb_units[0]))
    for m in range(len(mb_units)):
        if m + 1 < len(mb_units):
            tasks.append(("rows", mb_units[m + 1]))
        tasks.append(("grads", mb_units[m]))
    if neg is not None:
        tasks.append(("grads", neg))
    return tasks


def _overlap(a0: float, a1: float, spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(a1, b1) - max(a0, b0)) for b0, b1 in spans)


def replay_step(main: list[dict[str, Any]], comm: list[dict[str, Any]], prefetch: list[dict[str, Any]],
                stats: dict[str, Any], duration: Callable[[dict[str, Any]], float], flops_per_s: float
                ) -> dict[str, Any]:
    """One rank's step at the target: the main thread, the communication thread (FIFO) and the prefetch
    thread, with each event's time from ``duration``. Returns the step's time, compute, exposed communication
    and every event with the part of it the main thread was blocked on."""
    tasks = comm_tasks(stats)
    per_task = [stats["unit_events"][u] if kind == "rows" else 1 for kind, u in tasks]
    if sum(per_task) != len(comm):
        raise ValueError(f"the communication thread issued {len(comm)} collectives; the engine's task order "
                         f"predicts {sum(per_task)} ({tasks})")
    out_events: list[dict[str, Any]] = []
    # the communication thread: a FIFO of tasks
    spans: list[tuple[float, float]] = []  # per event
    done: list[float] = []  # per task
    free = 0.0
    at = 0
    submitted: dict[int, float] = {}

    def run_task(k: int) -> None:
        nonlocal free, at
        start = max(free, submitted[k])
        for _ in range(per_task[k]):
            d = duration(comm[at])
            spans.append((start, start + d))
            start += d
            at += 1
        free = start
        done.append(start)

    index = {task: k for k, task in enumerate(tasks)}
    blocked: list[tuple[float, float]] = []
    t = 0.0

    def submit(kind: str, u: int) -> None:
        k = index[(kind, u)]
        submitted[k] = t
        while len(done) <= k:  # FIFO: tasks run in submission order
            run_task(len(done))

    def wait(kind: str, u: int) -> None:
        nonlocal t
        end = done[index[(kind, u)]]
        if end > t:
            blocked.append((t, end))
            t = end

    compute = 0.0
    mb_units, neg = stats["mb_units"], stats["neg_unit"]
    if neg is not None:
        submit("rows", neg)
    submit("rows", mb_units[0])
    for m, u in enumerate(mb_units):
        if m == 0 and neg is not None:
            wait("rows", neg)
        wait("rows", u)
        if m + 1 < len(mb_units):
            submit("rows", mb_units[m + 1])
        c = stats["mb_flops"][m] / flops_per_s
        t += c
        compute += c
        submit("grads", u)
    if neg is not None:
        submit("grads", neg)
    for kind, u in tasks:
        if kind == "grads":
            wait(kind, u)
    for e, (a, b) in zip(comm, spans, strict=True):
        out_events.append({**_brief(e), "ms": 1e3 * (b - a), "exposed_ms": 1e3 * _overlap(a, b, blocked)})
    # the collectives after the loop, in log order; each async all-reduce (dense buckets, stats) runs until
    # its wait (the waits come in launch order)
    running: list[tuple[float, dict[str, Any]]] = []
    for e in main:
        d = 0.0 if e["op"] == "wait" else duration(e)
        if e["op"] == "all_reduce" and e["async_op"]:
            rec = {**_brief(e), "ms": 1e3 * d, "exposed_ms": 0.0}
            running.append((t + d, rec))
            out_events.append(rec)
        elif e["op"] == "wait":
            if running:
                end, rec = running.pop(0)
                if end > t:
                    rec["exposed_ms"] += 1e3 * (end - t)
                    t = end
        else:
            out_events.append({**_brief(e), "ms": 1e3 * d, "exposed_ms": 1e3 * d})
            t += d
    for end, rec in running:  # no wait logged: the step waits
        if end > t:
            rec["exposed_ms"] += 1e3 * (end - t)
            t = end
    # the prefetch thread: the next batch's lookup, beside the whole step; the next step waits for the rest
    pre = 0.0
    for e in prefetch:
        d = duration(e)
        out_events.append({**_brief(e), "ms": 1e3 * d, "exposed_ms": 1e3 * max(0.0, min(d, pre + d - t))})
        pre += d
    step = max(t, pre)
    return {"step_s": step, "compute_s": compute, "exposed_comm_s": step - compute,
            "comm_s": sum(ev["ms"] for ev in out_events) / 1e3, "events": out_events}


def _brief(e: dict[str, Any]) -> dict[str, Any]:
    role = ("prefetch" if e["thread"].startswith(PREFETCH_THREAD)
            else "comm" if e["thread"].startswith(COMM_THREAD) else "main")
    return {"op": e["op"], "group": e["group"], "thread": role, "async": e["async_op"], "dtype": e["dtype"],
            "logged_bytes": e["nbytes"]}


def split_step(events: list[dict[str, Any]], step: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                                                  list[dict[str, Any]]]:
    """(main, comm, prefetch) events of one step of one rank. The prefetch thread's lookups are taken in
    order (one lookup: a counts exchange and a keys All2All), the k-th being the one issued during step k:
    the step marker can move on while a lookup finishes, so its marker is not used."""
    ordered = sorted(events, key=lambda e: e["start"])
    mine = [e for e in ordered if e["step"] == step and not e["thread"].startswith(PREFETCH_THREAD)]
    # the communication thread issues every device collective: its rows and gradient All2Alls are its tasks;
    # the rest (dense buckets, replica sum, clipping norm, stats) the main thread waits for in turn after the
    # loop, so they are replayed as the main thread's own
    comm = [e for e in mine if e["thread"].startswith(COMM_THREAD) and e["op"] in ("all_to_all", "exchange")]
    main = [e for e in mine if not (e["thread"].startswith(COMM_THREAD) and e["op"] in ("all_to_all", "exchange"))]
    pre_all = [e for e in ordered if e["thread"].startswith(PREFETCH_THREAD)]
    lookups: list[list[dict[str, Any]]] = []
    for e in pre_all:
        if e["op"] == "exchange" or not lookups:
            lookups.append([])
        lookups[-1].append(e)
    pre = lookups[step] if step < len(lookups) else []
    return main, comm, pre


@dataclass(frozen=True)
class Assumptions:
    net: NetworkModel
    peak_tflops: float
    mfu: float
    union_scale: float = 1.0


def simulate(ranks: list[dict[str, Any]], steps: list[int], target: Target, logged: Logged,
             union: Callable[[float], float], a: Assumptions) -> dict[str, Any]:
    """The target's step: for each logged step, the slowest rank's replayed step; averaged over steps."""
    flops_per_s = a.peak_tflops * 1e12 * a.mfu
    per_step = []
    for s in steps:
        replays = []
        for r in ranks:
            main, comm, pre = split_step(r["events"], s)
            main = union_events_at(main, target, logged, union, a.union_scale)
            scaled = {id(e): scale_bytes(e, target, logged, union, a.union_scale) for e in main + comm + pre}

            def duration(e: dict[str, Any], scaled: dict[int, float] = scaled) -> float:
                return event_seconds(e, scaled[id(e)], target, a.net)

            rep = replay_step(main, comm, pre, r["stats"][s], duration, flops_per_s)
            for ev, e in zip(rep["events"], _event_order(main, comm, pre), strict=True):
                ev["bytes"] = scaled[id(e)]
            replays.append(rep)
        per_step.append(max(replays, key=lambda x: x["step_s"]))
    mean = {k: statistics.mean(p[k] for p in per_step) for k in ("step_s", "compute_s", "exposed_comm_s", "comm_s")}
    return {**mean, "events": per_step[0]["events"]}


def _event_order(main: list[dict[str, Any]], comm: list[dict[str, Any]], pre: list[dict[str, Any]]
                 ) -> list[dict[str, Any]]:
    """The events in the order ``replay_step`` reports them (comm, main without waits, prefetch)."""
    return comm + [e for e in main if e["op"] != "wait"] + pre


def scaling(ranks: list[dict[str, Any]], steps: list[int], workers: list[int], G: int, d_model: int,
            dense_params: int, logged: Logged, union: Callable[[float], float], a: Assumptions
            ) -> list[dict[str, Any]]:
    rows = []
    for W in workers:
        res = simulate(ranks, steps, Target(W, min(G, W), d_model, dense_params), logged, union, a)
        rows.append({"workers": W, **res})
    base = rows[0]["step_s"]
    for row in rows:
        row["scaling_efficiency"] = base / row["step_s"]
    return rows


SENSITIVE = ("intra_gbps", "inter_gbps", "intra_latency_us", "inter_latency_us", "host_gbps", "host_latency_us",
             "compute (peak x MFU)",
             "replica union (rows every replica touched)")


def vary(a: Assumptions, name: str, factor: float) -> Assumptions:
    if name == "compute (peak x MFU)":
        return replace(a, mfu=a.mfu * factor)
    if name.startswith("replica union"):
        return replace(a, union_scale=a.union_scale * factor)
    return replace(a, net=replace(a.net, **{name: getattr(a.net, name) * factor}))


# -- the logged run ------------------------------------------------------------------------------------------------
def batch_stats(batch: Any, cfg: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """What the replay needs of one rank's batch (``harness.run_modes``' ``on_batch`` observer): per
    micro-batch its lookup unit and the target model's training FLOPs, the collectives each unit's rows take,
    the batch's shared-negatives unit, its deduplicated keys, and the ids it drew (sequences / negatives)."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from grstack.runtime.bench.mfu import ModelDims, batch_flops

    dims = ModelDims(**payload["target_dims"])
    ranking = bool(cfg.model.ranking_head) and cfg.loss.ranking_weight > 0
    flops = [batch_flops(dims, SimpleNamespace(micro=[mb], batch_neg_ids=batch.batch_neg_ids), ranking).step
             for mb in batch.micro]
    keys = torch.unique(torch.cat([u.keys for u in batch.units])).numpy().astype(np.int32)
    seq_ids = sum(mb.full.item_ids.numel() + mb.targets.numel() for mb in batch.micro)
    if batch.batch_neg_ids is not None:
        negs = batch.batch_neg_ids.numel()
    else:
        negs = sum(mb.neg_ids.numel() for mb in batch.micro if mb.neg_ids is not None)
    return {"mb_units": [mb.unit for mb in batch.micro], "mb_flops": flops, "neg_unit": batch.neg_unit,
            "unit_events": [2 if cfg.negatives.fp16 and u.has_half else 1 for u in batch.units],
            "keys": keys, "seq_ids": int(seq_ids), "negatives": int(negs)}


def run_config(target: Any, quick: bool, nproc: int, group: int, microbatches: int) -> Any:
    from grstack.runtime.bench.train import bench_config
    from grstack.runtime.train import with_overrides

    narrow = {"model.d_model": 64, "model.num_blocks": 1, "model.num_heads": 2, "model.dqk": 32, "model.dv": 32,
              "model.dropout": 0.0, "model.input_dropout": 0.0}
    common = {"distributed.sparse_group_size": group, "train.num_threads": 1, "train.device": "cpu",
              "train.precision": "fp32", "pipeline.dbp": True, "pipeline.microbatches": microbatches,
              "pipeline.semi_async": False}
    if quick:
        return with_overrides(bench_config(True, microbatches), common)
    return with_overrides(target, {**narrow, **common, "balance.calibrate": False})


def record(cfg: Any, target_cfg: Any, nproc: int, steps: int) -> list[dict[str, Any]]:
    from grstack.runtime.train import call_ranks

    m = target_cfg.model
    payload = {"config": cfg.model_dump(mode="json"), "modes": {"log": {}}, "steps": steps, "params": False,
               "comm_log": True, "on_batch": "grstack.runtime.bench.simulate:batch_stats",
               "target_dims": {"kind": m.type, "d_model": m.d_model, "num_blocks": m.num_blocks,
                               "num_heads": m.num_heads, "dqk": m.dqk, "dv": m.dv, "ffn_mult": m.ffn_mult}}
    res = call_ranks("grstack.runtime.train.harness:run_modes", nproc, payload, limit_s=1200)
    return [{"rank": i, "events": r["log"]["comm_log"], "stats": r["log"]["batch_stats"],
             "step_ms": [x["step_ms"] for x in r["log"]["records"]]} for i, r in enumerate(res)]


def _with_keys(ranks: list[dict[str, Any]], convert: Callable[[Any], Any]) -> list[dict[str, Any]]:
    """``ranks`` with each batch's key set converted: arrays in memory, tensors in a saved log (a log is read
    with torch's restricted unpickler, which builds tensors but no numpy objects)."""
    return [{**r, "stats": [{**s, "keys": convert(s["keys"])} for s in r["stats"]]} for r in ranks]


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from grstack.runtime.bench.mfu import count_parameters
    from grstack.runtime.config_files import config_path
    from grstack.runtime.data import load_source
    from grstack.runtime.errors import UserError
    from grstack.runtime.model import atomic_torch_save, load_checkpoint, task_names
    from grstack.runtime.training_config import load_config

    workers = sorted(int(x) for x in args.workers.split(","))
    target_cfg = load_config(config_path(args.config), [])
    steps = args.steps or (5 if args.quick else 4)
    if steps < 3:
        raise UserError("--steps: at least 3 (the first and last steps are not steady)")
    cfg = run_config(target_cfg, args.quick, args.nproc, args.log_group, args.microbatches)
    if args.from_log:
        saved = load_checkpoint(Path(args.from_log), "run log")
        ranks = _with_keys(saved["ranks"], lambda k: k.numpy())
        cfg = load_config_dump(saved["config"])
    else:
        _log(f"logging a {args.nproc}-rank run (sparse groups of {args.log_group}, {steps} steps, "
             f"{cfg.data.source} data, d={cfg.model.d_model})")
        ranks = record(cfg, target_cfg, args.nproc, steps)
        if args.save_log:
            atomic_torch_save({"ranks": _with_keys(ranks, torch.from_numpy), "config": cfg.model_dump(mode="json")},
                              Path(args.save_log))
    nproc = len(ranks)
    group = cfg.distributed.sparse_group_size or nproc
    ops = {(e["op"], e["group"]) for r in ranks for e in r["events"]}
    if nproc // group > 1 and not any(g.startswith("replica") for _, g in ops):
        raise UserError("the logged run has replicas but no replica collectives were logged")
    ds = load_source(cfg.data)
    item_counts = np.bincount(ds.item_ids, minlength=ds.num_items + 1)[1:]
    key_sets = [s["keys"] for r in ranks for s in r["stats"]]
    negs = statistics.mean(s["negatives"] for r in ranks for s in r["stats"])
    union = UnionModel(item_counts, statistics.mean(len(k) for k in key_sets), negs)
    measured_union = UnionModel.measured(key_sets)
    check = [{"rank_batches": n + 1, "measured": u, "model": union(n + 1)} for n, u in enumerate(measured_union)]
    steady = list(range(1, steps - 1))
    dense = count_parameters(target_cfg.model, ds.num_items, target_cfg.data.max_len, len(task_names(ds)))["dense"]
    a = Assumptions(NetworkModel(args.devices_per_node, args.intra_gbps, args.inter_gbps, args.intra_latency_us,
                                 args.inter_latency_us, args.host_gbps, args.host_latency_us),
                    args.peak_tflops, args.mfu)
    logged = Logged(nproc, group, cfg.model.d_model, ds.num_items + 1)
    d_t = target_cfg.model.d_model

    def eff(assume: Assumptions) -> list[dict[str, Any]]:
        return scaling(ranks, steady, workers, args.sparse_group, d_t, dense, logged, union, assume)

    rows = eff(a)
    top = rows[-1]
    sensitivity = {}
    for name in SENSITIVE:
        sensitivity[name] = {f"x{f:g}": vary_eff for f, vary_eff in
                             ((f, eff(vary(a, name, f))[-1]["scaling_efficiency"]) for f in (0.5, 2.0))}
        sensitivity[name]["max_change"] = max(abs(v - top["scaling_efficiency"])
                                              for v in sensitivity[name].values())
    most = max(sensitivity, key=lambda k: sensitivity[k]["max_change"])
    exposed = sorted(top["events"], key=lambda ev: -ev["exposed_ms"])[0] if top["events"] else None
    out = {
        "kind": "model, not a measurement",
        "workers": workers,
        "scaling_efficiency": top["scaling_efficiency"],
        "published": PUBLISHED,
        "rows": [{"workers": r["workers"], "step_ms": 1e3 * r["step_s"], "compute_ms": 1e3 * r["compute_s"],
                  "exposed_comm_ms": 1e3 * r["exposed_comm_s"], "comm_ms": 1e3 * r["comm_s"],
                  "scaling_efficiency": r["scaling_efficiency"]} for r in rows],
        "events_per_step": [{**{k: v for k, v in ev.items() if k != "logged_bytes"},
                             "overlapped": ev["exposed_ms"] < 1e-9} for ev in top["events"]],
        "events_per_step_note": f"rank with the slowest step of logged step {steady[0]}, at {workers[-1]} workers; "
                                "bytes at the target, logged_bytes in the log",
        "network_model": {"parameters": {**a.net.__dict__, "sparse_group": args.sparse_group},
                          "formulas": a.net.formulas()},
        "compute_model": {"peak_tflops": args.peak_tflops, "mfu": args.mfu,
                          "flops": "bench.mfu counting of each logged micro-batch for the target model "
                                   f"(d={d_t}, {target_cfg.model.num_blocks} blocks); host work not modelled",
                          "dense_params": dense},
        "byte_scaling": scale_bytes.__doc__.split("\n\n", 1)[1].strip(),
        "union_of_touched_rows": {"model": UnionModel.__doc__.replace("\n", " "), "fitted_k": union.k,
                                  "negatives_per_rank_batch": negs, "items": union.num_items,
                                  "at_workers": {str(W): union(W) for W in workers},
                                  "check_against_logged_key_sets": check},
        "logged_run": {"ranks": nproc, "sparse_group": group, "steps": steps, "steady_steps": steady,
                       "data": cfg.data.source, "d_model": cfg.model.d_model,
                       "microbatches": cfg.pipeline.microbatches, "dbp": cfg.pipeline.dbp,
                       "collectives": sorted({f"{op}@{g}" for op, g in ops}),
                       "events_per_rank_step": statistics.mean(
                           sum(1 for e in r["events"] if e["step"] == s) for r in ranks for s in steady),
                       "cpu_step_ms_rank0": ranks[0]["step_ms"]},
        "sensitivity": {"what": f"scaling efficiency at {workers[-1]} workers with one assumption halved / "
                                "doubled, the rest as stated", "baseline": top["scaling_efficiency"],
                        **sensitivity},
        "rests_most_on": (f"{most}: halving / doubling it moves the efficiency at {workers[-1]} workers to "
                          f"{sensitivity[most]['x0.5']:.4f} / {sensitivity[most]['x2']:.4f} (from "
                          f"{top['scaling_efficiency']:.4f}); the largest exposed event at {workers[-1]} is "
                          + (f"{exposed['op']} on {exposed['group']} ({exposed['exposed_ms']:.2f} ms exposed)"
                             if exposed else "none")),
        "not_modelled": "host work (batch preparation, the sparse optimizer, index ops), link contention between "
                        "concurrent collectives, stragglers beyond the logged ranks' own batches, congestion and "
                        "topology beyond two link classes, and NCCL algorithm choice beyond min(ring, tree)",
    }
    print(json.dumps(out, indent=2))
    return 0


def load_config_dump(tree: dict[str, Any]) -> Any:
    from grstack.runtime.training_config import Config

    return Config.model_validate(tree)
