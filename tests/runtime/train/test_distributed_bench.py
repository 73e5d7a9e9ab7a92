"""``bench train`` prints what it promises (shape and invariants, not speed). ``bench simulate`` is tested
in tests/runtime/bench/test_simulate*.py."""

import json

import pytest

from grstack.runtime.cli import main

pytestmark = pytest.mark.integration

TRAIN_KEYS = {"imbalance_before", "imbalance_after", "imbalance_cost_model", "imbalance_measured", "step_ms",
              "blocked_comm_ms", "exposed_comm_ratio", "microbatches", "unique_keys_per_microbatch", "dbp_max_abs_diff",
              "fwp_max_abs_diff", "tokens_per_second", "embedding_step_ms", "embedding_step_ratio",
              "embedding_step_ms_pipelined", "embedding_step_ratio_pipelined", "embedding_step_spread_ms",
              "embedding_ids", "cluster_ms_per_batch", "clustering", "events_read_fraction_max",
              "table_rows_fraction_max", "sharded_data", "collectives", "host_syncs_per_step"}
SPLITS = {"before", "after"}


def test_bench_train_prints_the_promised_json(capsys):
    assert main(["bench", "train", "--quick", "--json", "--steps", "1", "--balance-steps", "2",
                 "--no-embedding"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == TRAIN_KEYS
    # the measured balance: wait ratios from every rank's busy times, beside the cost model's
    m = out["imbalance_measured"]
    assert m["ranks"] == 2 and m["timed_steps"] == 2 and m["same_global_batches"] is True
    for figures in (m, m["mean"], m["p10"], m["p90"], m["imbalance"], m["cpu"], m["cost_model"]):
        assert set(figures) >= SPLITS and all(0 <= figures[s] < 1 for s in SPLITS), figures
    assert m["cost_model"]["after"] <= m["cost_model"]["before"] and 0 <= m["noise_floor"] < 0.5
    assert "cost model" in out["imbalance_cost_model"] and 0 < out["exposed_comm_ratio"] <= 1
    # the compute thread's waits, counted once: never more than the step itself
    assert set(out["blocked_comm_ms"]) == set(out["step_ms"])
    assert all(0 <= out["blocked_comm_ms"][m] <= out["step_ms"][m] for m in out["step_ms"])
    assert set(out["step_ms"]) == {"sync", "dbp", "fwp", "fwp_clustered"}
    assert set(out["unique_keys_per_microbatch"]) == {"random", "clustered"}
    assert out["embedding_step_ms"] == out["embedding_step_ms_pipelined"] == {"grstack": None, "torchrec": None}
    assert out["embedding_step_ratio"] is out["embedding_step_ratio_pipelined"] is out["embedding_ids"] is None
    assert out["dbp_max_abs_diff"] == 0.0 and out["fwp_max_abs_diff"] < 1e-4
    assert out["imbalance_after"] <= 0.03 < out["imbalance_before"]
    assert out["unique_keys_per_microbatch"]["clustered"] < out["unique_keys_per_microbatch"]["random"]
    assert out["microbatches"] == 4 and out["tokens_per_second"] > 0
    # every pipeline mode's collectives, logged on both ranks and audited: one order, one issuing thread each
    col = out["collectives"]
    assert col["modes"] == ["sync", "dbp", "fwp", "fwp_clustered", "semi_async"] == list(col["per_mode"])
    assert col["order_violations"] == 0 and col["issuing_threads_per_communicator_max"] == 1
    assert col["device_issuing_threads_per_rank_max"] == 1  # grstack-comm issues every device collective
    for mode, a in col["per_mode"].items():
        assert a["communicators"]["world[0, 1]"]["device"] and a["communicators"]["sparse-fwd[0, 1]"]["device"]
        assert all(len(set(c["issues"].values())) == 1 for c in a["communicators"].values()), mode
    # DBP and FWP route the next batch on the prefetch group's host twin
    assert "sparse-pre-meta[0, 1]" in col["per_mode"]["dbp"]["communicators"]
    hs = out["host_syncs_per_step"]
    assert "upper bound" in hs["counter"] and set(hs["per_mode"]) == set(col["modes"])  # the CPU proxy, labelled
    assert hs["value"] == max(hs["per_mode"].values()) >= 0
    # ranks that read only their shares: the busiest reader decoded about half of the events
    sd = out["sharded_data"]
    assert sd["ranks"] == 2 and len(sd["events_read_fraction"]) == 2 and sd["steps"] > 0
    assert 0.4 <= out["events_read_fraction_max"] <= 0.6 and sum(sd["events_read_fraction"]) == pytest.approx(1.0)
    # the clustering's host cost at KuaiRand-like lengths with group-shared negatives, and what it saves
    c = out["clustering"]
    assert out["cluster_ms_per_batch"] == c["cluster_ms_per_batch"] > 0 and c["keys_per_token"] > 10
    assert c["unique_keys_total"]["clustered"] <= c["unique_keys_total"]["contiguous"]
