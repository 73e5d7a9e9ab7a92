"""HSTU and SASRec on jagged batches: forward/backward, causality, candidate isolation."""

import pytest
import torch

from grstack import kernels
from grstack.runtime.data.candidates import append_candidates
from grstack.runtime.data.jagged import JaggedBatch
from grstack.runtime.model import HSTU, SASRec, build_model
from grstack.runtime.training_config import ModelConfig

pytestmark = pytest.mark.unit


def _batch(lengths, num_items=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths).cumsum(0)
    n = int(offsets[-1])
    return JaggedBatch(item_ids=torch.randint(1, num_items + 1, (n,), generator=g), offsets=offsets,
                       timestamps=torch.randint(0, 10**6, (n,), generator=g).sort().values)


@pytest.mark.parametrize("kind", ["hstu", "sasrec"])
def test_forward_backward_every_parameter_gets_a_gradient(kind):
    model = build_model(ModelConfig(type=kind, d_model=16, num_blocks=2, num_heads=2, dqk=8, dv=8),
                        num_items=50, max_len=20, num_tasks=2)
    batch = _batch([5, 1, 12, 3])
    out = model.encode(batch)
    assert out.shape == (21, 16)
    loss = model.query_vectors(out).sum() + model.item_vectors(batch.item_ids).sum()
    if kind == "hstu":
        full, is_hist = append_candidates(batch, torch.randint(1, 51, (4, 3)), torch.full((4,), 10**6))
        cand_out = model.encode(full)[~is_hist]
        loss = loss + model.rank_logits(cand_out, full.item_ids[~is_hist]).sum()
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing


@pytest.mark.parametrize("kind", ["hstu", "sasrec"])
def test_outputs_are_causal(kind):
    model = build_model(ModelConfig(type=kind, d_model=16, num_blocks=2, num_heads=2, dqk=8, dv=8,
                                    dropout=0.0, input_dropout=0.0), num_items=50, max_len=20).eval()
    batch = _batch([9])
    prefix = JaggedBatch(item_ids=batch.item_ids[:5], offsets=torch.tensor([0, 5]),
                         timestamps=batch.timestamps[:5])
    with torch.no_grad():
        torch.testing.assert_close(model.encode(batch)[:5], model.encode(prefix), rtol=1e-5, atol=1e-6)


def test_candidates_do_not_change_history_outputs_and_not_each_other():
    model = HSTU(50, max_len=20, d_model=16, num_blocks=2, num_heads=2, dqk=8, dv=8, dropout=0.0,
                 input_dropout=0.0).eval()
    batch = _batch([6, 3])
    cands = torch.tensor([[1, 2, 3], [4, 5, 6]])
    ts = torch.tensor([2 * 10**6, 2 * 10**6])
    with torch.no_grad():
        hist_only = model.encode(batch)
        full, is_hist = append_candidates(batch, cands, ts)
        out = model.encode(full)
        torch.testing.assert_close(out[is_hist], hist_only, rtol=1e-5, atol=1e-6)
        # a candidate's output is the same whatever the other candidates are
        cands2 = torch.tensor([[1, 9, 9], [4, 9, 9]])
        out2 = model.encode(append_candidates(batch, cands2, ts)[0])
        first = torch.tensor([6, 12])  # first candidate of each user in the combined layout
        torch.testing.assert_close(out[first], out2[first], rtol=1e-5, atol=1e-6)


def test_sasrec_rejects_indivisible_heads():
    with pytest.raises(ValueError, match="divisible"):
        SASRec(10, max_len=5, d_model=10, num_heads=3)


def test_encode_runs_under_inference_mode():
    model = HSTU(50, max_len=20, d_model=16, num_blocks=2, num_heads=2, dqk=8, dv=8).eval()
    batch = _batch([5, 9, 1])
    with torch.no_grad():
        want = model.encode(batch)
    with torch.inference_mode():
        got = model.encode(batch)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", ["reference", "padded"])  # head-major and token-major prefix K/V
def test_encode_with_prefix_equals_encode_on_the_whole_sequences(backend):
    """Relay inference as the model owns it: per-layer K/V of each prefix (prefilled in chunks), then the new
    tokens (history suffix + candidates) encoded against them, equal encode()'s rows for those tokens."""
    torch.manual_seed(0)
    model = HSTU(50, max_len=40, d_model=16, num_blocks=2, num_heads=2, dqk=8, dv=4, dropout=0.0,
                 input_dropout=0.0).eval()
    with torch.no_grad():
        for layer in model.layers:  # visible biases
            layer.pos_weight.normal_(0.0, 0.5)
            layer.time_weight.normal_(0.0, 0.5)
        batch = _batch([9, 1, 14, 6], seed=3)
        cands = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]])
        full, _ = append_candidates(batch, cands, torch.full((4,), 2 * 10**6))
        want = model.encode(full)
        prefix_lens = [4, 0, 14, 5]  # a whole history cached, none, and partial ones
        offs = full.offsets.tolist()
        keys, values, pts, new_rows = [], [], [], []
        for b, p in enumerate(prefix_lens):
            s0 = offs[b]
            k, v = None, None
            for c0 in range(0, p, 3):  # prefill in chunks of 3 tokens
                c1 = min(p, c0 + 3)
                k, v = model.prefill_kv(full.item_ids[s0 + c0:s0 + c1], full.timestamps[s0 + c0:s0 + c1], k, v,
                                        full.timestamps[s0:s0 + c0], backend=backend)
            if k is None:
                k, v = model.empty_prefix_kv(backend)
            assert all(model.prefix_layout(backend).length(t) == p for t in k + v)
            keys.append(k)
            values.append(v)
            pts.append(full.timestamps[s0:s0 + p])
            new_rows += range(s0 + p, offs[b + 1])
        new_rows = torch.tensor(new_rows)
        new_lengths = torch.tensor([offs[b + 1] - offs[b] - p for b, p in enumerate(prefix_lens)])
        got, _, _ = model.encode_with_prefix(full.item_ids[new_rows], full.timestamps[new_rows],
                                             kernels.lengths_to_offsets(new_lengths), keys, values, pts,
                                             num_targets=full.num_targets, backend=backend)
    torch.testing.assert_close(got, want[new_rows], rtol=1e-5, atol=1e-5)


def test_sasrec_builds_its_plan_from_the_host_lengths_without_reading_the_offsets():
    """SASRec's attention runs per length group on every device, so it builds the plan once per forward for
    all blocks: from the batch's host lengths, with no read of the offsets (nothing the host-sync counter
    sees); a batch without them (built on a device) costs the one read of the offsets."""
    from grstack.kernels import HostSyncCount

    model = SASRec(20, max_len=16, d_model=8, num_blocks=3, num_heads=2, dropout=0.0, input_dropout=0.0).eval()
    batch = _batch([3, 9, 1, 6], num_items=20)
    assert batch.host_lengths == (3, 9, 1, 6)
    with torch.no_grad(), HostSyncCount("cpu") as syncs:
        out = model.encode(batch)
    assert dict(syncs.by_kind) == {}
    batch.host_lengths = None  # what a batch built on a device without them has
    with torch.no_grad(), HostSyncCount("cpu") as syncs:
        read = model.encode(batch)
    assert dict(syncs.by_kind) == {"tolist": 1}
    assert torch.equal(out, read)


def test_sasrec_encodes_a_device_batch_with_host_lengths_and_reads_no_data():
    """On ``meta`` (shapes, no data: any read of the offsets raises, as it would sync on an accelerator) the
    forward runs from the host lengths alone; without them the plan's read of the offsets is what fails."""
    model = SASRec(20, max_len=16, d_model=8, num_blocks=2, num_heads=2, dropout=0.0,
                   input_dropout=0.0).eval().to("meta")
    batch = _batch([3, 9, 0, 6], num_items=20).to("meta")
    with torch.no_grad():
        assert model.encode(batch).shape == (18, 8)
        batch.host_lengths = None
        with pytest.raises(NotImplementedError, match="meta"):
            model.encode(batch)
