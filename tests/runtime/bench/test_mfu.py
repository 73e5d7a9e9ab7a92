"""``grstack bench mfu``: the FLOPs formula against hand counts and the kernels' own mask, the parameter count
against built models, the peak table, the command's JSON on CPU and its errors, and the large config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grstack import kernels
from grstack.runtime.bench.mfu import (
    ModelDims,
    attention_pairs,
    batch_flops,
    count_parameters,
    find_peak,
    forward_flops,
    peak_precision,
)
from grstack.runtime.cli import main
from grstack.runtime.data.synth import PRESETS
from grstack.runtime.model import build_model
from grstack.runtime.training_config import ModelConfig, load_config

pytestmark = pytest.mark.unit

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
TINY = str(CONFIGS / "synthetic-tiny-hstu.yaml")
LARGE = CONFIGS / "kuairand-27k-hstu-large.yaml"
FIVE = {"flops_per_step", "step_ms", "achieved_tflops", "peak_tflops", "mfu"}


# -- the formula --------------------------------------------------------------------------------------------------
def test_hstu_forward_flops_match_a_hand_count():
    # d=4, 2 blocks, 2 heads, dqk=3, dv=2; histories of 3 and 1 tokens, 2 candidates each, 5 negatives, 3 tasks
    dims = ModelDims("hstu", d_model=4, num_blocks=2, num_heads=2, dqk=3, dv=2)
    got = forward_flops(dims, [3, 1], candidates=2, negatives_per_token=5, ranking_tasks=3)
    # tokens: 3 + 1 history + 2 x 2 candidates = 8
    # per token and block: uvqk 2*4*2*(2*2 + 2*3) = 160, output 2*2*2*4 = 32 -> 192; 2 blocks x 8 x 192
    assert got.linear == 3072
    # pairs: h=3: 3*4/2 = 6 history + 2 candidates x 4 (3 history + itself) = 14; h=1: 1 + 2 x 2 = 5 -> 19
    # per pair and block: 2*2*(3 + 2) = 20; 2 blocks x 19 x 20
    assert got.attention_pairs == 19
    assert got.attention == 760
    # 4 history tokens x 2*4*(1 positive + 5 negatives)
    assert got.loss == 192
    # 4 candidates x (2*8*4 + 2*4*3)
    assert got.ranking_head == 352
    assert got.forward == 3072 + 760 + 192 + 352
    assert got.step == 3 * 4376
    assert (got.history_tokens, got.candidate_tokens, got.tokens, got.sequences) == (4, 4, 8, 2)


def test_hstu_without_candidates_and_without_ranking_head():
    dims = ModelDims("hstu", d_model=4, num_blocks=1, num_heads=1, dqk=2, dv=2)
    got = forward_flops(dims, [2], negatives_per_token=1)
    # 2 tokens x (2*4*1*8 + 2*1*2*4) = 2 x 80; pairs 3 x 2*1*4; loss 2 x 2*4*2; no head
    assert (got.linear, got.attention, got.loss, got.ranking_head) == (160, 24, 32, 0)


def test_fuxi_forward_flops_match_a_hand_count():
    # d=4, 1 block, 1 head, dqk=dv=2, ffn 1x, all three channels; one history of 2 tokens, 1 negative
    dims = ModelDims("fuxi", d_model=4, num_blocks=1, num_heads=1, dqk=2, dv=2, channels=3)
    got = forward_flops(dims, [2], negatives_per_token=1)
    # per token: uvqk 2*4*(3*2 + 2 + 2*2) = 96, back to d 2*6*4 = 48, SwiGLU 3 x 2*4*4 = 96 -> 240; 2 tokens
    assert got.linear == 480
    # 3 pairs x (semantic 2*1*(2 + 2) + 2 bias channels x 2*2) = 3 x 16
    assert got.attention == 48


def test_sasrec_forward_flops_match_a_hand_count():
    dims = ModelDims("sasrec", d_model=4, num_blocks=1, num_heads=2, ffn_mult=2)
    got = forward_flops(dims, [2], negatives_per_token=3)
    # per token: qkv 2*4*12 = 96, proj 2*4*4 = 32, ffn 2 x 2*4*8 = 128 -> 256; 2 tokens
    assert got.linear == 512
    # 3 causal pairs x 4*4 (Q.K and A.V over 2 heads of 2)
    assert got.attention == 48
    assert got.loss == 2 * 2 * 4 * (1 + 3)
    with pytest.raises(ValueError):
        forward_flops(dims, [2], candidates=1)


@pytest.mark.parametrize("hist, m", [([1, 5, 9], 0), ([1, 5, 9], 3), ([4], 1)])
def test_attention_pairs_are_the_kernels_allowed_pairs(hist, m):
    """Counts the pairs through the kernels' own attention: with Q·Kᵀ = 30 everywhere (SiLU(30) = 30 to
    1e-12), V = 1 and no bias, a query's output is 30 x (its allowed keys) / max_seq_len."""
    lengths = [h + m for h in hist]
    offsets = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()])
    n = int(offsets[-1])
    q = torch.full((n, 1, 3), 10.0 ** 0.5, dtype=torch.float64)
    v = torch.ones(n, 1, 1, dtype=torch.float64)
    num_targets = torch.full((len(hist),), m) if m else None
    out = kernels.hstu_attention(q, q.clone(), v, offsets, max_seq_len=64, num_targets=num_targets,
                                 backend="reference")
    allowed = (out[:, 0, 0] * 64 / 30).round().sum()
    assert int(allowed) == attention_pairs(hist, m)


def test_batch_flops_read_the_prepared_batch():
    """On a real PreparedBatch of the tiny config: its history tokens, appended candidates, negatives per
    token and tasks, summed over micro-batches."""
    from grstack.runtime.data import LeaveOneOut, load_source
    from grstack.runtime.model import task_names
    from grstack.runtime.train import Preparer, Schedule

    cfg = load_config(TINY, ["pipeline.microbatches=2", "loss.sharing=token", "negatives.share_k=2"])
    ds = load_source(cfg.data)
    split = LeaveOneOut(ds, min_len=cfg.data.min_len)
    M = cfg.loss.ranking_candidates
    schedule = Schedule(split, cfg, 1, M)
    batch = Preparer(schedule, cfg, 0, ds.num_items, len(task_names(ds)), True)(0, 0, 0)
    assert len(batch.micro) == 2
    dims = ModelDims.of(cfg.model)
    got = batch_flops(dims, batch, ranking=True)
    hist = schedule.lengths[schedule.step_rows(0, 0)].tolist()
    want = forward_flops(dims, hist, M, cfg.loss.negatives * 2, len(task_names(ds)))
    assert got.history_tokens == batch.local_tokens == sum(hist)
    assert got.candidate_tokens == M * batch.local_seqs
    assert (got.linear, got.attention, got.loss, got.ranking_head) == (
        want.linear, want.attention, want.loss, want.ranking_head)
    assert batch_flops(dims, batch, ranking=False).ranking_head == 0


# -- parameters ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", [
    {"type": "hstu", "d_model": 16, "num_blocks": 2, "num_heads": 2, "dqk": 4, "dv": 8},
    {"type": "hstu", "d_model": 16, "num_blocks": 1, "num_heads": 1, "position_bias": False, "time_bias": False,
     "ranking_head": False},
    {"type": "sasrec", "d_model": 16, "num_blocks": 2, "num_heads": 2, "ffn_mult": 3},
    {"type": "fuxi", "d_model": 16, "num_blocks": 2, "num_heads": 2, "dqk": 4, "dv": 8, "ffn_mult": 2},
    {"type": "fuxi", "d_model": 16, "num_blocks": 1, "num_heads": 1, "time_bias": False, "ranking_head": False},
])
def test_count_parameters_equals_the_built_model(model):
    cfg = ModelConfig(**model)
    built = build_model(cfg, 50, 20, num_tasks=3)
    counted = count_parameters(cfg, 50, 20, 3)
    table = built.item_emb.weight.numel()
    assert counted["item_table"] == table == 51 * 16
    assert counted["total"] == sum(p.numel() for p in built.parameters())
    assert counted["dense"] == counted["total"] - table


def test_large_config_validates_and_is_about_0_2b_parameters():
    cfg = load_config(LARGE)
    assert (cfg.data.format, cfg.data.source, cfg.data.max_len) == ("synth", "27k", 4096)
    assert cfg.train.precision == "bf16"
    assert cfg.optim.schedule == "cosine" and cfg.optim.warmup_steps > 0
    assert cfg.eval.max_users is not None and cfg.eval.max_users <= 1000
    items, tasks = PRESETS["27k"].num_items, 4  # the next item + click, like, long view
    counted = count_parameters(cfg.model, items, cfg.data.max_len, tasks)
    assert 0.15e9 <= counted["total"] <= 0.25e9
    with torch.device("meta"):  # the real module's shapes, no memory
        model = build_model(cfg.model, items, cfg.data.max_len, num_tasks=tasks)
    assert sum(p.numel() for p in model.parameters()) == counted["total"]
    # the protocol text states the arithmetic: its totals must be the model's
    text = cfg.protocol.replace(",", "")
    for key in ("dense", "item_table", "total"):
        assert str(counted[key]) in text


# -- the peak table ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA H200", "bf16", 989.4),
    ("NVIDIA H200", "tf32", 494.7),
    ("NVIDIA H200", "fp32", 66.9),
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
    ("NVIDIA H100 PCIe", "bf16", 756.0),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
    ("Ascend910B2C", "bf16", 376.0),
])
def test_peak_table(name, precision, peak):
    entry, value, note = find_peak(name, precision)
    assert entry is not None and value == peak and note is None


def test_unknown_accelerators_and_precisions_have_no_peak():
    entry, value, note = find_peak("NVIDIA GeForce GTX 1080", "bf16")
    assert entry is None and value is None and "no peak" in note
    entry, value, note = find_peak("Ascend910B2", "fp32")
    assert entry is not None and value is None and "fp32" in note
    assert find_peak("Ascend910B3", "bf16")[1] is None


def test_which_peak_applies():
    assert peak_precision("bf16", False) == "bf16"
    assert peak_precision("bf16", True) == "bf16"
    assert peak_precision("fp32", True) == "tf32"
    assert peak_precision("fp32", False) == "fp32"


# -- the command --------------------------------------------------------------------------------------------------
def test_cli_on_cpu_prints_achieved_flops_and_null_peak(capsys):
    code = main(["bench", "mfu", "--config", TINY, "--device", "cpu", "--steps", "2", "--json", "--threads", "1"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= FIVE
    assert out["peak_tflops"] is None and out["mfu"] is None
    assert out["flops_per_step"] > 0 and out["step_ms"] > 0 and out["achieved_tflops"] > 0
    assert out["achieved_tflops"] == pytest.approx(out["flops_per_step"] / out["step_ms"] / 1e9)
    assert out["steps"] == 2 and out["warmup"] == 2 and out["device"] == "cpu"
    assert out["flops_per_step"] == pytest.approx(sum(out["flops_per_step_by_part"].values()))
    assert out["parameters"]["total"] == out["parameters"]["dense"] + out["parameters"]["item_table"]
    assert out["parameters"]["item_table"] == 801 * 32  # the tiny preset's 800 items + padding, d = 32
    assert out["candidate_tokens_per_step"] == 8 * out["sequences_per_step"]
    assert "3 x forward" in out["formula"]


@pytest.mark.parametrize("argv, message", [
    (["--config", "no-such-config.yaml"], "no config named"),
    (["--config", TINY, "--steps", "0"], "--steps: 0 is out of range"),
    (["--config", TINY, "--device", "tpu"], "unknown device"),
])
def test_bad_input_is_one_error_line(capsys, argv, message):
    assert main(["bench", "mfu", *argv, "--threads", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1]
