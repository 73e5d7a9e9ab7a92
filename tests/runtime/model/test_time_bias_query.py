"""``model.time_bias_query``: the query times HSTU gives the time bias (self / next), their round trip through
the exported artefact, and the refusal to serve a ``next`` model from cached prefixes."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch

from grstack import kernels
from grstack.runtime.data.candidates import append_candidates
from grstack.runtime.data.dataset import from_sequences
from grstack.runtime.data.jagged import JaggedBatch
from grstack.runtime.errors import UserError
from grstack.runtime.model import HSTU, build_model, export_model, load_exported
from grstack.runtime.model.hstu import next_event_timestamps
from grstack.runtime.serve.artifact import load_ranking_model
from grstack.runtime.serve.engine import RelayEngine
from grstack.runtime.training_config import Config

pytestmark = pytest.mark.unit


def _expected_next(ts: list[int], lengths: list[int], num_targets: list[int] | None) -> list[int]:
    """The convention spelled out: a history token takes the next token's time (for the last history token
    the first candidate's, or its own without candidates); candidates keep their own."""
    out, start = [], 0
    for b, n in enumerate(lengths):
        hist = n - (num_targets[b] if num_targets is not None else 0)
        for i in range(n):
            out.append(ts[start + i + 1] if i < hist and i + 1 < n else ts[start + i])
        start += n
    return out


@pytest.mark.parametrize("num_targets", [None, [0, 0, 1, 2, 3, 1]])
def test_next_event_timestamps_on_a_jagged_batch(num_targets: list[int] | None) -> None:
    lengths = [4, 0, 1, 5, 3, 2]  # an empty sequence, a lone token, all-candidate and one-history sequences
    ts = (torch.arange(sum(lengths)) * 10 + 100).tolist()
    offsets = kernels.lengths_to_offsets(torch.tensor(lengths))
    nt = torch.tensor(num_targets) if num_targets is not None else None
    got = next_event_timestamps(torch.tensor(ts), offsets, nt)
    assert got.tolist() == _expected_next(ts, lengths, num_targets)
    if num_targets is None:  # Meta's cat(ts[1:], ts[-1:]) per sequence
        assert got[:4].tolist() == [110, 120, 130, 130]


def _batch(lengths: list[int], seed: int = 0) -> JaggedBatch:
    g = torch.Generator().manual_seed(seed)
    offsets = kernels.lengths_to_offsets(torch.tensor(lengths))
    n = sum(lengths)
    return JaggedBatch(item_ids=torch.randint(1, 51, (n,), generator=g), offsets=offsets,
                       timestamps=torch.randint(0, 10**8, (n,), generator=g).sort().values)


def _model(query: str, time_bias: bool = True) -> HSTU:
    torch.manual_seed(0)
    return HSTU(50, max_len=20, d_model=16, num_blocks=2, num_heads=2, dqk=8, dv=8, dropout=0.0,
                input_dropout=0.0, time_bias_query=query, time_bias=time_bias).eval()


@pytest.mark.parametrize("with_candidates", [False, True])
def test_encode_passes_the_next_query_times_to_every_layer(with_candidates: bool) -> None:
    batch = _batch([6, 1, 9])
    nts = None
    if with_candidates:
        batch, _ = append_candidates(batch, torch.randint(1, 51, (3, 2)), torch.tensor([2, 3, 4]) * 10**8)
        nts = [2, 2, 2]
    lengths = batch.lengths.tolist()
    seen = []
    real = kernels.hstu_attention

    def spy(*args, **kwargs):
        seen.append(kwargs["query_timestamps"])
        return real(*args, **kwargs)

    with torch.no_grad(), mock.patch.object(kernels, "hstu_attention", spy):
        nxt = _model("next").encode(batch)
        want = _expected_next(batch.timestamps.tolist(), lengths, nts)
        assert len(seen) == 2 and all(s.tolist() == want for s in seen)
        seen.clear()
        own = _model("self").encode(batch)
        assert seen == [None, None]
    assert (nxt - own).abs().max() > 1e-4  # same weights: the convention changes the outputs


def test_next_without_time_bias_is_self() -> None:
    batch = _batch([5, 3])
    with torch.no_grad():
        torch.testing.assert_close(_model("next", time_bias=False).encode(batch),
                                   _model("self", time_bias=False).encode(batch), rtol=0, atol=0)


def _config(query: str) -> Config:
    return Config.model_validate({"name": "tbq", "data": {"format": "parquet", "source": "(none)", "max_len": 20},
                                  "model": {"type": "hstu", "d_model": 16, "num_blocks": 2, "num_heads": 2,
                                            "dqk": 8, "dv": 8, "dropout": 0.0, "input_dropout": 0.0,
                                            "time_bias_query": query}})


def test_the_option_round_trips_through_the_artifact(tmp_path) -> None:
    cfg = _config("next")
    ds = from_sequences([0], [np.array([1, 2, 3])], [np.array([1, 2, 3])], num_items=50)
    torch.manual_seed(0)
    model = build_model(cfg.model, 50, 20).eval()
    export_model(model, cfg, ds, tmp_path / "model.pt")
    loaded, got_cfg, _ = load_exported(tmp_path / "model.pt")
    assert loaded.time_bias_query == "next" and got_cfg.model.time_bias_query == "next"
    batch = _batch([7, 2])
    with torch.no_grad():
        torch.testing.assert_close(loaded.encode(batch), model.encode(batch), rtol=0, atol=0)
    assert _config("self").model.time_bias_query == "self" == Config.model_validate(
        {"name": "d"}).model.time_bias_query


def test_an_unknown_value_is_rejected() -> None:
    with pytest.raises(Exception, match="time_bias_query"):
        _config("prev")


def test_a_next_model_is_not_served_from_cached_prefixes(tmp_path) -> None:
    """Cached prefixes would not be exact (the last prefix token depends on the next event's time), and the
    cache keeps no item ids to recompute it: the model, the engine and the serving loader refuse it."""
    model = _model("next")
    keys, values = model.empty_prefix_kv()
    with pytest.raises(ValueError, match=r"model\.time_bias_query=next"):
        model.encode_with_prefix(torch.tensor([1, 2]), torch.tensor([5, 6]), torch.tensor([0, 2]), [keys],
                                 [values], [torch.zeros(0, dtype=torch.int64)])
    with pytest.raises(ValueError, match=r"model\.time_bias_query"):
        model.prefill_kv(torch.tensor([1, 2]), torch.tensor([5, 6]))
    with pytest.raises(ValueError, match=r"model\.time_bias_query=self"):
        RelayEngine(model, max_suffix=4)
    cfg = _config("next")
    cfg.model.ranking_head = True
    ds = from_sequences([0], [np.array([1, 2, 3])], [np.array([1, 2, 3])], num_items=50)
    export_model(build_model(cfg.model, 50, 20), cfg, ds, tmp_path / "model.pt")
    with pytest.raises(UserError, match=r"model\.time_bias_query=self"):
        load_ranking_model(tmp_path / "model.pt")
    RelayEngine(_model("next", time_bias=False), max_suffix=4)  # no time bias: nothing depends on what follows
