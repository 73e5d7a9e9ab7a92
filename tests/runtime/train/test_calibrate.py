"""The balancer's cost weights from measured times (``train/calibrate.py``): the fit, the chosen lengths,
profiles, the timing leaving the run's state alone, and a one-rank run that never calibrates."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from grstack_testing import cyclic_dataset, tiny_config_args, write_cyclic

from grstack.runtime.data.splits import LeaveOneOut
from grstack.runtime.errors import UserError
from grstack.runtime.model import task_names
from grstack.runtime.train import calibrate
from grstack.runtime.train.batching import Schedule
from grstack.runtime.train.context import DistContext
from grstack.runtime.train.trainer import build_engine, config_mismatch, make_plan, train
from grstack.runtime.training_config import Config, load_config

pytestmark = pytest.mark.unit

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "synthetic-tiny-hstu.yaml"


@pytest.fixture
def one_thread():
    """One intra-op thread, as training runs (and restored after: the trainer sets it for the process)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- the fit --------------------------------------------------------------------------------------------------
def test_the_fit_recovers_known_weights_from_exact_timings():
    L = np.array([20, 50, 120, 300, 700, 1000])
    a, b, c = 0.04, 6e-5, 3.0
    got = calibrate.fit_cost(L, c + a * L + b * L * L)
    assert got["a"] == pytest.approx(a, rel=1e-9) and got["b"] == pytest.approx(b, rel=1e-9)
    assert got["c"] == pytest.approx(c, rel=1e-9) and got["r2"] == pytest.approx(1.0)
    # without the intercept (timings of the pure a·L + b·L² model)
    got = calibrate.fit_cost(L, a * L + b * L * L, intercept=False)
    assert (got["a"], got["b"], got["c"]) == (pytest.approx(a), pytest.approx(b), 0.0)


def test_the_fit_recovers_known_weights_through_timing_noise():
    rng = np.random.default_rng(0)
    L = np.repeat([44, 80, 146, 274, 446, 630, 813, 997], 7)
    a, b, c = 0.035, 5e-5, 4.0
    ms = (c + a * L + b * L * L) * rng.lognormal(0.0, 0.05, L.size)  # 5% multiplicative noise
    got = calibrate.fit_cost(L, ms)
    assert got["b"] / got["a"] == pytest.approx(b / a, rel=0.3)
    assert got["r2"] > 0.95


def test_the_fit_never_returns_a_negative_weight():
    L = np.array([10.0, 100.0, 200.0, 400.0])
    # concave timings: least squares alone would make b negative
    got = calibrate.fit_cost(L, 5.0 + 2.0 * np.sqrt(L))
    assert got["a"] > 0 and got["b"] == 0.0 and got["c"] >= 0.0
    # timings that fall with length: only the intercept is left
    got = calibrate.fit_cost(L, 100.0 - 0.1 * L)
    assert got["a"] == 0.0 and got["b"] == 0.0 and got["c"] > 0


def test_weights_are_normalised_to_one_tokens_linear_cost():
    assert calibrate.weights(0.04, 1e-4) == (1.0, pytest.approx(2.5e-3))
    assert calibrate.weights(0.0, 1e-4) == (0.0, 1.0)
    assert calibrate.weights(0.0, 0.0) is None


def test_the_median_over_ranks_and_repeats_is_fitted():
    per_rank = [[[1.0, 2.0, 9.0], [4.0, 5.0, 6.0]], [[2.0, 2.0, 2.0], [5.0, 5.0, 50.0]]]
    got = calibrate.fit_timings(np.array([10, 20]), per_rank)
    assert got["lengths"] == [10, 20] and got["ms"] == [2.0, 5.0]
    assert calibrate.fit_timings(np.array([10]), [[[1.0]]])["a"] == 0.0  # one length: nothing to fit


# -- lengths --------------------------------------------------------------------------------------------------
def test_calibration_lengths_span_the_data_from_its_p10_to_its_longest():
    lengths = np.minimum(np.random.default_rng(0).lognormal(np.log(150), 1.0, 3000).astype(np.int64) + 10, 997)
    t = calibrate.calibration_lengths(lengths)
    assert t[0] == round(np.percentile(lengths, 10)) and t[-1] == lengths.max()
    assert np.all(np.diff(t) > 0) and 5 <= len(t) <= 9
    rows = calibrate.pick_rows(lengths, t)
    got = lengths[rows]
    assert np.all(np.diff(got) > 0)  # distinct, shortest first
    assert all(np.min(np.abs(lengths - x)) == np.min(np.abs(got - x)) for x in t)
    assert len(calibrate.calibration_lengths(np.full(10, 7))) == 1


# -- profiles and the schedule --------------------------------------------------------------------------------
def test_a_profile_round_trips_and_bad_ones_are_named(tmp_path):
    fitted = {"a": 0.04, "b": 1e-4, "c": 2.0, "r2": 0.99, "lengths": [10, 20], "ms": [2.4, 2.8]}
    calibrate.write_profile(tmp_path / "p.json", fitted)
    assert calibrate.read_profile(tmp_path / "p.json") == fitted
    assert calibrate.read_profile(_write(tmp_path / "min.json", {"a": 1, "b": 0.005})) == {"a": 1, "b": 0.005}
    with pytest.raises(UserError, match="cannot read"):
        calibrate.read_profile(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(UserError, match="not valid JSON"):
        calibrate.read_profile(tmp_path / "bad.json")
    for bad, msg in (({"a": -1, "b": 0.1}, "'a' must be a non-negative"), ({"a": 1}, "'b' must be"),
                     ({"a": 0, "b": 0}, "both 0"), ([1, 2], "JSON object")):
        with pytest.raises(UserError, match=msg):
            calibrate.read_profile(_write(tmp_path / "x.json", bad))


def _write(path, obj):
    path.write_text(json.dumps(obj))
    return path


def _heavy_split():
    return LeaveOneOut(cyclic_dataset(num_users=80, min_len=6, max_len=300, seed=1))


def test_the_schedule_splits_by_the_weights_it_is_given():
    cfg = Config.model_validate({"data": {"max_len": 300}, "train": {"batch_size": 16}})
    s = Schedule(_heavy_split(), cfg, world_size=2, ranking_candidates=0)
    rows = s.step_rows(0, 0)
    assert (s.cost_a, s.cost_b) == (1.0, 0.01)
    default = s.parts(rows)
    s.set_weights(1.0, 0.0)  # tokens only: equal token counts
    linear = s.parts(rows)
    tokens = [int(s.lengths[rows[p]].sum()) for p in linear]
    assert abs(tokens[0] - tokens[1]) <= s.lengths[rows].max()
    assert [p.tolist() for p in default] != [p.tolist() for p in linear]
    assert np.allclose(s.costs(rows, linear), tokens)


def test_a_resume_ignores_calibrate_and_profile_but_not_the_weights():
    saved = Config().model_dump(mode="json")
    del saved["balance"]["calibrate"], saved["balance"]["profile"]  # a checkpoint from before calibration
    now = Config.model_validate({"balance": {"calibrate": True, "profile": "p.json"}}).model_dump(mode="json")
    assert config_mismatch(saved, now) == []
    now["balance"]["cost_b"] = 0.005
    assert config_mismatch(saved, now) == ["balance.cost_b"]


# -- timing ---------------------------------------------------------------------------------------------------
def test_timing_leaves_the_rng_the_model_and_its_gradients_alone(one_thread):
    cfg = Config.model_validate({"data": {"max_len": 60}, "model": {"d_model": 16, "num_blocks": 1, "num_heads": 2,
                                                                    "dqk": 8, "dv": 8},
                                 "loss": {"negatives": 8, "ranking_candidates": 3}})
    split = LeaveOneOut(cyclic_dataset(num_users=40, min_len=6, max_len=80))
    ctx = DistContext.single(torch.device("cpu"))
    built = build_engine(cfg, ctx, make_plan(cfg, ctx, split.ds.num_items), split, task_names(split.ds))
    state = {k: v.clone() for k, v in built.model.state_dict().items()}
    rng = torch.get_rng_state()
    rows = calibrate.pick_rows(built.schedule.lengths, calibrate.calibration_lengths(built.schedule.lengths))
    times = calibrate.time_rows(built.engine, built.schedule, built.preparer, rows, repeats=2)
    assert len(times) == len(rows) >= 3 and all(len(t) == 2 and min(t) > 0 for t in times)
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in built.model.parameters())
    assert all(torch.equal(state[k], v) for k, v in built.model.state_dict().items())
    fitted = calibrate.calibrate(built.engine, built.schedule, built.preparer, ctx, repeats=2)
    assert fitted["lengths"] == [int(x) for x in built.schedule.lengths[rows] + 3]  # + the candidates
    assert fitted["ranks"] == 1 and len(fitted["ms"]) == len(rows)
    built.engine.close()


# -- one rank ------------------------------------------------------------------------------------------------
def test_one_rank_never_calibrates_and_trains_exactly_as_without_it(tmp_path, monkeypatch, one_thread):
    data = write_cyclic(tmp_path / "data", num_users=60, max_len=60)
    args = [*tiny_config_args(data), "data.max_len=50", "train.epochs=1", "train.num_threads=1"]

    def no_timing(*a, **k):
        raise AssertionError("a one-rank run must not calibrate")

    monkeypatch.setattr(calibrate, "calibrate", no_timing)
    on = train(load_config(CONFIG, [*args, "balance.calibrate=true"]), tmp_path / "on", progress=False)
    off = train(load_config(CONFIG, [*args, "balance.calibrate=false"]), tmp_path / "off", progress=False)
    assert on["balance"] == off["balance"] == {"mode": "tokens", "cost_a": 1.0, "cost_b": 0.01,
                                               "source": "config", "fitted": None}
    assert not (tmp_path / "on" / calibrate.PROFILE).exists()
    recs = [[{k: v for k, v in json.loads(x).items() if not any(t in k for t in ("_ms", "per_second", "measured"))}
             for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()] for run in ("on", "off")]
    assert recs[0] == recs[1] and len(recs[0]) > 3
    a = torch.load(tmp_path / "on" / "model.pt", weights_only=False)["state_dict"]
    b = torch.load(tmp_path / "off" / "model.pt", weights_only=False)["state_dict"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert on["metrics"] == off["metrics"]


def test_ranks_timing_their_own_rows_are_pooled_by_length():
    # rank 0 timed lengths 10 and 20, rank 1 (other data) 10 and 30: each length's median over all its timings
    got = calibrate.fit_pooled([([10, 20], [[1.0, 3.0], [5.0, 5.0]]), ([10, 30], [[2.0, 2.0], [9.0, 7.0]])])
    assert got["lengths"] == [10, 20, 30] and got["ms"] == [2.0, 5.0, 8.0]
    # ranks holding the same data: the same fit as fit_timings of those rows
    same = [([10, 20], [[1.0, 2.0, 9.0], [4.0, 5.0, 6.0]]), ([10, 20], [[2.0, 2.0, 2.0], [5.0, 5.0, 50.0]])]
    assert calibrate.fit_pooled(same) == calibrate.fit_timings(np.array([10, 20]), [t for _, t in same])
