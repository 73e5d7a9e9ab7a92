"""Properties of the jagged (length-grouped) reference the serving path relies on: causality, candidate isolation,
plan coverage. (Equality with the dense padded implementation, fwd and bwd: test_properties.py.)"""

import pytest
import torch

from grstack.kernels import AttentionInputs, make_plan
from grstack.kernels.reference import hstu_attention_reference

pytestmark = pytest.mark.unit


def _case(lengths, heads=2, dqk=8, dv=4, seed=0, with_targets=False):
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = lens.cumsum(0)
    n = int(offsets[-1])
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_(True)  # noqa: E731
    q, k, v = mk(n, heads, dqk), mk(n, heads, dqk), mk(n, heads, dv)
    ts = torch.randint(0, 10**7, (n,), generator=g).sort().values
    pos_w, time_w = mk(64), mk(33)
    nt = None
    if with_targets:
        nt = torch.tensor([min(length, int(torch.randint(0, 4, (1,), generator=g))) for length in lengths])
    return q, k, v, offsets, ts, pos_w, time_w, nt


def test_causality_prefix_outputs_do_not_depend_on_appended_tokens():
    """What relay inference relies on: appending tokens leaves the prefix's outputs unchanged."""
    q, k, v, _, ts, pos_w, time_w, _ = _case([12])
    full = hstu_attention_reference(AttentionInputs(q, k, v, torch.tensor([0, 12]), max_seq_len=64, timestamps=ts,
                                                    pos_weight=pos_w, time_weight=time_w))
    prefix = hstu_attention_reference(AttentionInputs(q[:7], k[:7], v[:7], torch.tensor([0, 7]), max_seq_len=64,
                                                      timestamps=ts[:7], pos_weight=pos_w, time_weight=time_w))
    torch.testing.assert_close(full[:7], prefix)


def test_candidates_see_history_and_themselves_only():
    q, k, v, _, ts, pos_w, time_w, _ = _case([8])
    nt = torch.tensor([3])
    kw = dict(max_seq_len=64, timestamps=ts, pos_weight=pos_w, time_weight=time_w, num_targets=nt)
    base = hstu_attention_reference(AttentionInputs(q, k, v, torch.tensor([0, 8]), **kw))
    v2 = v.detach().clone()
    v2[6] += 100.0  # perturb one candidate: other candidates must not move, nor the history
    moved = hstu_attention_reference(AttentionInputs(q, k, v2, torch.tensor([0, 8]), **kw))
    changed = (moved - base).abs().amax(dim=(1, 2)) > 1e-9
    assert changed.tolist() == [False] * 6 + [True, False]


def test_plan_groups_cover_every_token_once_and_bound_padding():
    lengths = [0, 1, 2, 3, 50, 51, 400, 7, 0, 1000]
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths).cumsum(0)
    plan = make_plan(offsets)
    covered = torch.cat([g.index.reshape(-1)[g.valid] for g in plan.groups])
    assert sorted(covered.tolist()) == list(range(sum(lengths)))
    padded_work = sum(len(g.seq) * g.max_len**2 for g in plan.groups)
    assert padded_work <= 2.0 * sum(length**2 for length in lengths)
