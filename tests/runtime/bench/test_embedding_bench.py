"""The embedding-step comparison of ``grstack bench train``: its Zipf ids, TorchRec's index dedup on CPU (the
bench gives fbgemm's CUDA-only ``jagged_unique_indices`` a CPU kernel) and one small run of both sides."""

import os
from pathlib import Path
from typing import Any

import pytest

from grstack.runtime.bench.train import _zipf_batches, embedding_rank, torchrec_available

pytestmark = pytest.mark.integration

HERE = str(Path(__file__).resolve().parent)
CHILD_ENV = {"PYTHONPATH": os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH", "")) if p)}
needs_torchrec = pytest.mark.skipif(not torchrec_available(), reason="torchrec is not installed")


def dedup_vs_plain(env: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """Rank body: TorchRec with index dedup (the bench's CPU kernel) and without, from the same weights, on
    the same Zipf ids; returns the largest output and weight differences."""
    import torch
    from torchrec import KeyedJaggedTensor
    from torchrec.datasets.utils import Batch

    from grstack.runtime.bench.train import _torchrec_model
    from grstack.runtime.train import DistContext

    DistContext(env, torch.device("cpu"), 0, 60.0)
    rows, dim = payload["rows"], 8
    w = torch.randn(dim, generator=torch.Generator().manual_seed(1))
    plain = _torchrec_model(env, rows, dim, w, dedup=False)
    dedup = _torchrec_model(env, rows, dim, w, dedup=True)
    dedup.load_state_dict(plain.state_dict())
    out_diff = []
    for ids, lengths in _zipf_batches(env.rank, 3, 4, rows, 1.05):
        values = []
        for model in (plain, dedup):
            batch = Batch(dense_features=torch.zeros(len(lengths), 1), labels=torch.zeros(len(lengths)),
                          sparse_features=KeyedJaggedTensor(keys=["item"], values=ids, lengths=lengths))
            model(batch)[0].sum().backward()
            values.append(model.module.ec(batch.sparse_features)["item"].values().detach())
        out_diff.append(float((values[0] - values[1]).abs().max()))
    key = next(k for k in plain.state_dict() if k.endswith("weight"))
    shards = [m.state_dict()[key].local_shards()[0].tensor for m in (plain, dedup)]
    return {"out_diff": max(out_diff), "weight_diff": float((shards[0] - shards[1]).abs().max()),
            "n_ids": sum(int(b[0].numel()) for b in _zipf_batches(env.rank, 3, 4, rows, 1.05))}


def test_zipf_ids_are_fixed_per_rank_and_step_and_skewed():
    a, b = _zipf_batches(0, 3, 8, 100_000, 1.05), _zipf_batches(0, 3, 8, 100_000, 1.05)
    other = _zipf_batches(1, 3, 8, 100_000, 1.05)
    for (ids, lengths), (ids2, lengths2), (ids3, _) in zip(a, b, other, strict=True):
        assert ids.equal(ids2) and lengths.equal(lengths2) and not ids.equal(ids3[: ids.numel()])
        assert ids.numel() == int(lengths.sum()) and int(ids.min()) >= 0 and int(ids.max()) < 100_000
        assert 0.3 < 1 - ids.unique().numel() / ids.numel() < 0.9  # uniform ids would repeat ~1%


@needs_torchrec
def test_torchrec_index_dedup_on_cpu_matches_torchrec_without_it():
    from grstack.runtime.train import call_ranks

    for r in call_ranks("test_embedding_bench:dedup_vs_plain", 2, {"rows": 5000}, env=CHILD_ENV):
        assert r["n_ids"] > 0 and r["out_diff"] < 1e-6 and r["weight_diff"] < 1e-6, r


def test_embedding_rank_times_every_step_of_both_sides():
    from grstack.runtime.train import call_ranks

    trec = torchrec_available()
    payload = {"rows": 20_000, "dim": 8, "seqs": 2, "steps": 4, "threads": 1, "exponent": 1.05,
               "torchrec": trec, "pipeline": trec}
    res = call_ranks(f"{embedding_rank.__module__}:embedding_rank", 2, payload)
    for r in res:
        assert len(r["grstack"]) == len(r["grstack_pipelined"]) == 4
        assert len(r["torchrec"]) == len(r["torchrec_pipelined"]) == (4 if trec else 0)
        assert len(r["duplicate_share"]) == 4 and all(0 < s < 1 for s in r["duplicate_share"])
        assert all(200 <= n <= 600 for n in r["ids_per_step"])
