"""Where every embedding row lives: row-wise sharding inside a sparse group, replication across groups.

``world_size`` ranks form ``world_size / group_size`` sparse groups of consecutive ranks. Inside a group,
row ``i`` is owned by the rank with shard index ``i % group_size`` and stored there as local row
``i // group_size`` (modulo placement spreads popular ids evenly, whatever their numbering). Ranks with the
same shard index in different groups hold replicas of the same shard; they apply the same summed gradients
so the replicas stay identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grstack.runtime.errors import UserError


@dataclass(frozen=True)
class ShardingPlan:
    num_rows: int
    dim: int
    world_size: int
    group_size: int

    @classmethod
    def make(cls, num_rows: int, dim: int, world_size: int, sparse_group_size: int = 0,
             max_shard_rows: int | None = None) -> ShardingPlan:
        """Validates the plan; an unsatisfiable one is a UserError naming the setting to change."""
        if world_size < 1:
            raise UserError(f"world size must be >= 1, got {world_size}")
        group = sparse_group_size or world_size
        if group > world_size or world_size % group:
            raise UserError(f"distributed.sparse_group_size={sparse_group_size} must divide the number of ranks "
                            f"({world_size})")
        if group > num_rows:
            raise UserError(f"distributed.sparse_group_size={group} exceeds the {num_rows} embedding rows to shard")
        plan = cls(num_rows=num_rows, dim=dim, world_size=world_size, group_size=group)
        need = plan.shard_rows(0)
        if max_shard_rows is not None and need > max_shard_rows:
            min_group = -(-num_rows // max_shard_rows)
            raise UserError(
                f"sharding plan cannot be satisfied: {num_rows} rows over sparse groups of {group} rank(s) need "
                f"{need} rows per rank, but distributed.max_shard_rows={max_shard_rows}; use groups of at least "
                f"{min_group} ranks (distributed.sparse_group_size) or more ranks")
        return plan

    @property
    def num_groups(self) -> int:
        return self.world_size // self.group_size

    def group_of(self, rank: int) -> int:
        return rank // self.group_size

    def shard_of(self, rank: int) -> int:
        return rank % self.group_size

    def replica_ranks(self, shard: int) -> list[int]:
        return [shard + g * self.group_size for g in range(self.num_groups)]

    def shard_rows(self, shard: int) -> int:
        """Rows held by shard ``shard`` (ids ``shard, shard + G, ...`` below num_rows)."""
        return max(0, -(-(self.num_rows - shard) // self.group_size))

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        return ids % self.group_size

    def local_row(self, ids: torch.Tensor) -> torch.Tensor:
        return ids // self.group_size

    def global_ids(self, shard: int, local: torch.Tensor) -> torch.Tensor:
        return local * self.group_size + shard

    def describe(self) -> dict[str, int]:
        return {"num_rows": self.num_rows, "dim": self.dim, "world_size": self.world_size,
                "sparse_group_size": self.group_size}
