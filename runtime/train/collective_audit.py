"""Audit of the order in which ranks issue collectives, from their ``CommLog`` events (``embedding.comm``).

Why: NCCL and HCCL require every rank to issue the operations of its communicators in one order — two ranks
that issue the same two collectives on different communicators in opposite orders can each block inside
the collective the other has not reached. Gloo tolerates more, so a CPU run does not deadlock where a
device run would; this audit reads the CPU form of the same program and says where it would.

Definitions (what ``audit_collectives`` returns):

* A *communicator* is identified by its group name and size (``group`` / ``group_size`` of the event), or
  by its name and member ranks when ``members`` is given (ranks in different groups of one name, e.g. the
  sparse groups of a 4-rank job with 2 per group, are then told apart). Barriers and object collectives
  (``META_OPS``) are logged under the Comm's name but run on its ``meta`` gloo twin (``comm.py``), so they
  count under ``<group>-meta``.
* On gloo a Comm is its own ``meta`` twin, so host data (keys, counts, sizes) is logged under the data
  group's name. With ``meta_inline`` (a gloo log) the audit attributes it as NCCL/HCCL would run it: a
  collective of an integer or bool tensor, ``all_gather_sizes`` and ``META_OPS`` count under
  ``<group>-meta`` (comm.py's contract: host data travels on the twin, device data is floating point).
* *Device* communicators: ``world``, ``sparse-fwd``, ``replica`` (``DEVICE_GROUPS``): on NCCL/HCCL they carry
  device tensors; on gloo they are the CPU form of the same program. *Host* communicators: every ``*-meta``
  gloo twin, and ``sparse-pre`` while it carries host data only (routing; on NCCL/HCCL it is then a gloo
  group). A ``sparse-pre`` that carries a floating-point tensor (rows or gradients) is a device
  communicator: such a collective needs an NCCL/HCCL group there.
* An *issue* is a logged collective other than ``wait`` (the wait of an async collective is not an issue;
  an async all-reduce is issued at its launch, which is what its ``all_reduce`` event records). A rank's
  issue order is its events sorted by ``start`` (the log's order breaks ties).
* ``order_violations`` = (a) + (b). (a) Each rank's merged sequence of (group, op) over the device
  communicators it shares with the reference rank (rank 0), compared position by position with rank 0's
  sequence restricted to the same communicators: the positions where they differ, each once (the same
  position mismatching on several ranks counts once), plus any length difference. (b) For every
  communicator, device or host, the same comparison of its own op sequence between each member and the
  lowest-ranked member that logged it.
* ``issuing_threads_per_communicator_max``: per communicator, the number of distinct ``thread`` names over
  its issue events on one rank; the max over ranks and communicators (0 when nothing was issued).

Details: per communicator its threads (every rank's, union), issues per rank, violations and first mismatch;
for the device order its violations, first mismatch (rank, index, what each side issued there) and
``threads_per_rank_max``: the most threads one rank issued device collectives from. One run's order is a
sample of the thread timing; a single issuing thread for all device communicators makes it the program
order on every run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

DEVICE_GROUPS = frozenset({"world", "sparse-fwd", "replica"})
META_OPS = frozenset({"barrier", "broadcast_object", "all_gather_object"})

Key = tuple[str, tuple[int, ...] | int]  # (group name, member ranks | group size)
Issue = tuple[str, str]  # (communicator label, op)


def is_floating(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat", "complex"))


def communicator_name(event: Mapping[str, Any], meta_inline: bool = False) -> str:
    """The group the event's collective ran on: ``META_OPS`` run on the Comm's gloo twin, and so, with
    ``meta_inline`` (module docstring), does host data."""
    group, op = str(event["group"]), str(event["op"])
    if group.endswith("-meta"):
        return group
    if op in META_OPS or (meta_inline and (op == "all_gather_sizes" or not is_floating(str(event["dtype"])))):
        return f"{group}-meta"
    return group


def device_names(events: Sequence[Mapping[str, Any]], meta_inline: bool = False) -> set[str]:
    """The device communicators among the groups of ``events`` (module docstring)."""
    names = {communicator_name(e, meta_inline) for e in events}
    carried = {communicator_name(e, meta_inline) for e in events if is_floating(str(e["dtype"]))}
    return {n for n in names if not n.endswith("-meta") and (n in DEVICE_GROUPS or n in carried)}


def _key(event: Mapping[str, Any], members: Mapping[str, Sequence[int]] | None, meta_inline: bool) -> Key:
    name = communicator_name(event, meta_inline)
    twin_of = name.removesuffix("-meta")  # a twin has its group's members (on gloo it is the group)
    if members is not None and (name in members or twin_of in members):
        return name, tuple(int(r) for r in members.get(name, members.get(twin_of, ())))
    return name, int(event["group_size"])


def _label(key: Key) -> str:
    name, who = key
    return f"{name}{list(who)}" if isinstance(who, tuple) else f"{name}/{who}"


def issues(events: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """A rank's issue events in issue order (``wait`` left out; stable on equal ``start``)."""
    return sorted((e for e in events if e["op"] != "wait"), key=lambda e: float(e["start"]))


def _mismatches(ref: Sequence[Issue], other: Sequence[Issue]) -> tuple[list[int], dict[str, Any] | None]:
    """Positions where ``other`` differs from ``ref`` (past the shorter one's end included) and the first."""
    n = max(len(ref), len(other))
    bad = [i for i in range(n) if i >= len(ref) or i >= len(other) or ref[i] != other[i]]
    if not bad:
        return bad, None
    i = bad[0]
    return bad, {"index": i, "reference": list(ref[i]) if i < len(ref) else None,
                 "issued": list(other[i]) if i < len(other) else None}


def audit_collectives(per_rank: Sequence[Sequence[Mapping[str, Any]]],
          members: Sequence[Mapping[str, Sequence[int]]] | None = None, meta_inline: bool = False
          ) -> dict[str, Any]:
    """``per_rank[r]``: rank r's CommLog events as dicts; ``members[r]`` (optional): {group name: member
    ranks} of rank r's communicators; ``meta_inline``: a gloo log (host data under the data group's name).
    Returns ``order_violations``, ``issuing_threads_per_communicator_max`` and the details (module
    docstring)."""
    ordered = [issues(events) for events in per_rank]
    device = set().union(*(device_names(evs, meta_inline) for evs in ordered))
    keyed = [[(_key(e, members[r] if members else None, meta_inline), e) for e in evs]
             for r, evs in enumerate(ordered)]

    # per communicator: each member's op sequence and its threads
    seqs: dict[Key, dict[int, list[Issue]]] = {}
    threads: dict[Key, dict[int, set[str]]] = {}
    for r, evs in enumerate(keyed):
        for key, e in evs:
            seqs.setdefault(key, {}).setdefault(r, []).append((_label(key), str(e["op"])))
            threads.setdefault(key, {}).setdefault(r, set()).add(str(e["thread"]))

    communicators: dict[str, dict[str, Any]] = {}
    per_comm_total = 0
    for key in sorted(seqs, key=_label):
        by_rank = seqs[key]
        ref = min(by_rank)
        bad: set[int] = set()
        first = None
        for r in sorted(by_rank):
            if r == ref:
                continue
            pos, mm = _mismatches(by_rank[ref], by_rank[r])
            bad.update(pos)
            if mm is not None and first is None:
                first = {"rank": r, "reference_rank": ref, **mm}
        per_comm_total += len(bad)
        communicators[_label(key)] = {
            "device": key[0] in device,
            "threads": sorted(set().union(*threads[key].values())),
            "threads_per_rank_max": max(len(t) for t in threads[key].values()),
            "issues": {r: len(s) for r, s in sorted(by_rank.items())},
            "violations": len(bad),
            "first_mismatch": first,
        }

    device_bad: set[tuple[frozenset[Key], int]] = set()
    device_first = None
    if keyed:
        ref_keys = {k for k, _ in keyed[0] if k[0] in device}
        for r in range(1, len(keyed)):
            shared = frozenset(ref_keys & {k for k, _ in keyed[r] if k[0] in device})
            a = [(_label(k), str(e["op"])) for k, e in keyed[0] if k in shared]
            b = [(_label(k), str(e["op"])) for k, e in keyed[r] if k in shared]
            pos, mm = _mismatches(a, b)
            device_bad.update((shared, i) for i in pos)
            if mm is not None and device_first is None:
                device_first = {"rank": r, "reference_rank": 0, **mm}

    return {
        "order_violations": len(device_bad) + per_comm_total,
        "issuing_threads_per_communicator_max": max(
            (c["threads_per_rank_max"] for c in communicators.values()), default=0),
        "device_order": {"violations": len(device_bad), "first_mismatch": device_first,
                         "threads_per_rank_max": max(
                             (len({str(e["thread"]) for k, e in evs if k[0] in device}) for evs in keyed),
                             default=0)},
        "communicators": communicators,
    }
