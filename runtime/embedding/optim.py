"""Optimizers for one embedding shard.

``step(rows, grad)`` takes sorted unique local row ids and their summed gradients and returns the rows it
changed and their new values (also written to the shard): the "Active buffer" the dual-buffer pipeline
refreshes prefetched rows from. The sparse ones (lazy Adam, row-wise Adagrad, SGD) read and write only the
rows a step touched; ``DenseAdamW`` is torch's AdamW over the whole shard (untouched rows have a zero
gradient but their moments still decay and they still move), so a one-shard run trains exactly as
``torch.optim.AdamW`` on an ``nn.Embedding`` would. Every operation is deterministic, so replicas given the
same gradients stay identical.
"""

from __future__ import annotations

from typing import Any

import torch


def fused_adamw(device: torch.device) -> bool | None:
    """``fused=`` for torch AdamW on ``device``: True where torch has the fused kernel (CPU, CUDA), else its
    default."""
    return True if device.type in ("cpu", "cuda") else None


class SparseOptimizer:
    name = "base"
    moves_all_rows = False  # True: every step changes every row (the Active rows are the whole shard)

    def __init__(self, weight: torch.Tensor, lr: float) -> None:
        self.weight = weight
        self.lr = lr
        self.steps = 0

    def step(self, rows: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Applies the summed gradient of ``rows``; returns (changed rows, their new values)."""
        self.steps += 1
        if rows.numel() == 0:
            return rows, grad.new_zeros((0, self.weight.shape[1]))
        new = self._update(rows, grad)
        self.weight.index_copy_(0, rows, new)
        return rows, new

    def _update(self, rows: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["name"] != self.name:
            raise ValueError(f"optimizer state is for {state['name']!r}, not {self.name!r}")
        self.steps = state["steps"]


class SparseSGD(SparseOptimizer):
    name = "sgd"

    def _update(self, rows: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        return self.weight.index_select(0, rows) - self.lr * grad


class RowWiseAdagrad(SparseOptimizer):
    """One accumulator per row (the mean squared gradient of the row), as in FBGEMM/TorchRec."""

    name = "adagrad"

    def __init__(self, weight: torch.Tensor, lr: float, eps: float = 1e-8) -> None:
        super().__init__(weight, lr)
        self.eps = eps
        self.acc = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)

    def _update(self, rows: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        acc = self.acc.index_select(0, rows) + grad.pow(2).mean(dim=1)
        self.acc.index_copy_(0, rows, acc)
        return self.weight.index_select(0, rows) - self.lr * grad / (acc.sqrt() + self.eps)[:, None]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "acc": self.acc}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.acc.copy_(state["acc"])


class LazyAdam(SparseOptimizer):
    """Adam whose moments are updated only on touched rows (torch.optim.SparseAdam's rule)."""

    name = "adam"

    def __init__(self, weight: torch.Tensor, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
        super().__init__(weight, lr)
        self.betas, self.eps = betas, eps
        self.m = torch.zeros_like(weight)
        self.v = torch.zeros_like(weight)

    def _update(self, rows: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        b1, b2 = self.betas
        m = self.m.index_select(0, rows).mul_(b1).add_(grad, alpha=1 - b1)
        v = self.v.index_select(0, rows).mul_(b2).addcmul_(grad, grad, value=1 - b2)
        self.m.index_copy_(0, rows, m)
        self.v.index_copy_(0, rows, v)
        bc1 = 1 - b1**self.steps
        bc2 = 1 - b2**self.steps
        step = (m / bc1) / ((v / bc2).sqrt() + self.eps)
        return self.weight.index_select(0, rows) - self.lr * step

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "m": self.m, "v": self.v}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.m.copy_(state["m"])
        self.v.copy_(state["v"])


class DenseAdamW(SparseOptimizer):
    """``torch.optim.AdamW`` (fused) over the whole shard: every row's moments decay and every row moves each step."""

    name = "adamw"
    moves_all_rows = True

    def __init__(self, weight: torch.Tensor, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0) -> None:
        super().__init__(weight, lr)
        self.param = torch.nn.Parameter(weight, requires_grad=False)  # shares storage with the shard
        # fused where torch has it, as the dense optimizer: the step count stays on the shard's device, so the
        # update reads no scalar back (the unfused form reads its host step count every step)
        self.inner = torch.optim.AdamW([self.param], lr=lr, betas=betas, weight_decay=weight_decay,
                                       fused=fused_adamw(weight.device))
        self._rows = torch.arange(weight.shape[0], device=weight.device)

    def step(self, rows: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.steps += 1
        full = torch.zeros_like(self.weight)
        full.index_copy_(0, rows, grad)
        self.param.grad = full
        for group in self.inner.param_groups:
            group["lr"] = self.lr
        self.inner.step()
        self.param.grad = None
        return self._rows, self.weight

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.inner.load_state_dict(state["inner"])


def make_sparse_optimizer(name: str, weight: torch.Tensor, lr: float,
                          betas: tuple[float, float] = (0.9, 0.999),
                          weight_decay: float = 0.0) -> SparseOptimizer:
    """The shard optimizer ``embedding.optimizer`` names (weight decay applies to ``adamw`` only)."""
    if name == "adamw":
        return DenseAdamW(weight, lr, betas, weight_decay)
    if name == "adam":
        return LazyAdam(weight, lr, betas)
    if name == "adagrad":
        return RowWiseAdagrad(weight, lr)
    if name == "sgd":
        return SparseSGD(weight, lr)
    raise ValueError(f"unknown sparse optimizer {name!r}")
