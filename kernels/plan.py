"""Per-batch plans the attention ops reuse in every layer.

:class:`JaggedPlan` (full attention): sequences are grouped into length classes (powers of 2^(1/4)); each
group is gathered into a small dense block padded only to that group's own longest sequence. Attention work
is then ``sum_g G_g * L_g^2``, within a small constant of the jagged ``sum_b L_b^2``, instead of
``B * L_max^2``. A plan depends only on the offsets, so a model computes it once per batch and reuses it in
every layer.

:class:`PrefixPlan` (attention of new tokens against a cached prefix): the batch's new-token offsets and
prefix lengths on the host; backends keep what they derive from the batch (masks, bias indices, device
offsets) in its ``cache``, so every layer of one forward reuses them.

:class:`PrefixLayout`: how a backend of the cached-prefix op wants each sequence's cached keys and values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

# Entries a plan's cache keeps (batch constants for a few (table size, dtype, ...) combinations).
_CACHE_ENTRIES = 4


@dataclass(frozen=True)
class Group:
    seq: torch.Tensor  # [G] sequence indices in the batch
    index: torch.Tensor  # [G, Lg] token index into the values (pad slots point at the zero row, sum_L)
    valid: torch.Tensor  # [G * Lg] bool, slots holding real tokens
    lengths: torch.Tensor  # [G]
    max_len: int
    # [sum of the group's lengths] the slots holding real tokens, in order (``valid``'s positions: selecting
    # them needs no data-dependent size, so no host sync on a device)
    slots: torch.Tensor


@dataclass(frozen=True)
class JaggedPlan:
    num_tokens: int
    groups: tuple[Group, ...]
    inverse: torch.Tensor  # [sum_L]: position of each token in the concatenation of the groups' valid slots
    # Batch-dependent constants (masks, bias indices) that kernels compute once and reuse in every layer.
    cache: dict = field(default_factory=dict, compare=False, repr=False)


def _length_class(length: int, steps_per_octave: int = 4) -> int:
    return 0 if length <= 1 else math.ceil(steps_per_octave * math.log2(length))


def _merge_classes(by_class: dict[int, list[int]], lengths: list[int], overhead: int) -> list[list[int]]:
    """Merges adjacent length classes where padding costs less than another group's fixed cost.

    A group of G sequences padded to L costs about ``overhead + G * L^2`` (attention elements per head, the
    overhead being the per-group op launches in the same unit). An O(K^2) dynamic programme over the K
    length classes (sorted by length) picks the cheapest partition into contiguous runs.
    """
    classes = sorted(by_class)
    if overhead <= 0 or len(classes) <= 1:
        return [by_class[c] for c in reversed(classes)]
    counts = [len(by_class[c]) for c in classes]
    maxes = [max(lengths[b] for b in by_class[c]) for c in classes]
    best = [0.0] + [math.inf] * len(classes)
    cut = [0] * (len(classes) + 1)
    for end in range(1, len(classes) + 1):
        n = 0
        for start in range(end - 1, -1, -1):
            n += counts[start]
            cost = best[start] + overhead + n * maxes[end - 1] ** 2
            if cost < best[end]:
                best[end], cut[end] = cost, start
    runs, end = [], len(classes)
    while end > 0:
        start = cut[end]
        runs.append([b for c in classes[start:end] for b in by_class[c]])
        end = start
    return runs  # longest first


def make_plan(offsets: torch.Tensor, steps_per_octave: int = 4, group_overhead: int = 4096, *,
              lengths: Sequence[int] | None = None) -> JaggedPlan:
    """Groups sequences of similar length; empty sequences are skipped.

    ``group_overhead`` (in attention elements per head, see :func:`_merge_classes`) trades padding for fewer
    groups; 0 keeps one group per length class. ``lengths``: the sequences' lengths on the host, as the batch
    builder knows them; given, the plan never reads ``offsets`` back from the device (no host sync). Built on
    the host and moved to the offsets' device in one copy (non-blocking on CUDA).
    """
    if lengths is None:
        lengths = (offsets[1:] - offsets[:-1]).to("cpu", torch.int64).tolist()  # the one host read
    else:
        lengths = [int(n) for n in lengths]
        if len(lengths) != offsets.numel() - 1:
            raise ValueError(f"{len(lengths)} lengths for {offsets.numel() - 1} sequences")
    starts_host = [0]
    for n in lengths:
        starts_host.append(starts_host[-1] + n)
    by_class: dict[int, list[int]] = {}
    for b, length in enumerate(lengths):
        if length > 0:
            by_class.setdefault(_length_class(length, steps_per_octave), []).append(b)
    num_tokens = starts_host[-1]
    host: list[tuple[torch.Tensor, ...]] = []
    order = []
    for seqs in _merge_classes(by_class, lengths, group_overhead):
        lens_list = [lengths[b] for b in seqs]
        lens = torch.tensor(lens_list, dtype=torch.int64)
        max_len = max(lens_list)
        starts = torch.tensor([starts_host[b] for b in seqs], dtype=torch.int64)
        ar = torch.arange(max_len, dtype=torch.int64)
        valid2d = ar[None, :] < lens[:, None]
        index = torch.where(valid2d, starts[:, None] + ar[None, :], torch.full_like(valid2d, num_tokens,
                                                                                 dtype=torch.int64))
        slots = torch.cat([torch.arange(i * max_len, i * max_len + n, dtype=torch.int64)
                           for i, n in enumerate(lens_list)])
        order.append(index.reshape(-1)[slots])
        host.append((torch.tensor(seqs, dtype=torch.int64), index, valid2d.reshape(-1).to(torch.int64), lens,
                     slots))
    inverse = torch.zeros(0, dtype=torch.int64)
    if order:
        inverse = torch.empty(num_tokens, dtype=torch.int64)
        inverse[torch.cat(order)] = torch.arange(num_tokens, dtype=torch.int64)
    moved = _to_device([t for parts in host for t in parts] + [inverse], offsets.device)
    groups = []
    for i, parts in enumerate(host):
        seq, index, valid, lens, slots = moved[5 * i:5 * i + 5]
        groups.append(Group(seq=seq, index=index, valid=valid.bool(), lengths=lens,
                            max_len=int(parts[1].shape[1]), slots=slots))
    return JaggedPlan(num_tokens=num_tokens, groups=tuple(groups), inverse=moved[-1])


def _to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """int64 host tensors -> views of one buffer on ``device``: one copy for the whole plan, from pinned
    memory without blocking the host on CUDA (the caching host allocator keeps the buffer until it is done)."""
    if device.type == "cpu":
        return tensors
    flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0, dtype=torch.int64)
    flat = flat.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else flat.to(device)
    out, at = [], 0
    for t in tensors:
        out.append(flat[at:at + t.numel()].view(t.shape))
        at += t.numel()
    return out


def gather_groups(x: torch.Tensor, plan: JaggedPlan) -> list[torch.Tensor]:
    """[sum_L, *D] -> per group [G, Lg, *D] (pad slots are zeros)."""
    ext = torch.cat([x, x.new_zeros((1, *x.shape[1:]))], dim=0)
    return [ext[g.index] for g in plan.groups]


def scatter_groups(blocks: list[torch.Tensor], plan: JaggedPlan) -> torch.Tensor:
    """Inverse of ``gather_groups``: per group [G, Lg, *D] -> [sum_L, *D] (pad slots dropped)."""
    parts = [blk.reshape(-1, *blk.shape[2:]).index_select(0, g.slots) for blk, g in zip(blocks, plan.groups,
                                                                                          strict=True)]
    if not parts:
        return blocks[0].new_zeros((0,)) if blocks else torch.zeros(0)
    return torch.cat(parts, dim=0)[plan.inverse]


def tensor_key(t: torch.Tensor | None):
    """Identity of a tensor's current contents, for memo keys (None stays None)."""
    if t is None:
        return None
    # Inference tensors have no version counter; they cannot be modified in place, so -1 is exact.
    version = -1 if t.is_inference() else t._version
    return (t.data_ptr(), version, tuple(t.shape), t.dtype, t.device)


def cached(plan: JaggedPlan | PrefixPlan, key, build: Callable[[], object], keep_alive: Sequence = ()):
    """Per-plan memo (a plan is built per batch and reused by all layers); holds ``keep_alive`` tensors so a
    data_ptr in the key cannot be reused by another tensor while the entry lives."""
    hit = plan.cache.get(key)
    if hit is not None:
        return hit[0]
    value = build()
    if len(plan.cache) >= _CACHE_ENTRIES:
        plan.cache.pop(next(iter(plan.cache)))
    plan.cache[key] = (value, tuple(keep_alive))
    return value


@dataclass(frozen=True)
class PrefixPlan:
    """One cached-prefix forward: sequence b's new tokens are rows ``offsets[b]:offsets[b+1]`` and follow a
    cached prefix of ``prefix_lengths[b]`` tokens (so they sit at positions ``prefix_lengths[b]..``)."""

    offsets: tuple[int, ...]  # [B + 1], host
    prefix_lengths: tuple[int, ...]  # [B], host
    # Batch-dependent constants that backends compute once and reuse in every layer.
    cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def batch_size(self) -> int:
        return len(self.prefix_lengths)


def make_prefix_plan(offsets: torch.Tensor | Sequence[int],
                     prefix_lengths: torch.Tensor | Sequence[int]) -> PrefixPlan:
    """Plan of a cached-prefix batch (pass host lists to avoid a device sync)."""
    offs = tuple(int(o) for o in (offsets.tolist() if isinstance(offsets, torch.Tensor) else offsets))
    plens = tuple(int(p) for p in (prefix_lengths.tolist() if isinstance(prefix_lengths, torch.Tensor)
                                   else prefix_lengths))
    if len(offs) != len(plens) + 1:
        raise ValueError(f"{len(offs)} offsets for {len(plens)} prefixes; expected B + 1 offsets for B prefixes")
    return PrefixPlan(offs, plens)


@dataclass(frozen=True)
class PrefixLayout:
    """How the cached-prefix op wants one sequence's keys or values of one layer.

    ``token_major``: [P, H, d] (the jagged token layout; Triton and the plain formulation);
    ``head_major``: [H, P, d] contiguous (the CPU path: ``q @ k^T`` is a batched matmul with no copy).
    """

    name: str
    seq_dim: int

    def from_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[n, H, d] (how projections come out) -> this layout."""
        return x.transpose(0, 1).contiguous() if self.seq_dim == 1 else x

    def to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """This layout -> [n, H, d] (a view)."""
        return x.transpose(0, 1) if self.seq_dim == 1 else x

    def empty(self, heads: int, dim: int, *, device: torch.device | str | None = None,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
        shape = (heads, 0, dim) if self.seq_dim == 1 else (0, heads, dim)
        return torch.zeros(shape, device=device, dtype=dtype)

    def length(self, x: torch.Tensor) -> int:
        return int(x.shape[self.seq_dim])

    def cat(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Concatenates along the sequence (e.g. a prefix and its next chunk)."""
        return torch.cat(list(parts), dim=self.seq_dim)


TOKEN_MAJOR = PrefixLayout("token_major", 0)
HEAD_MAJOR = PrefixLayout("head_major", 1)
