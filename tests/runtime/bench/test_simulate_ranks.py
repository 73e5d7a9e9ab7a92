"""``bench simulate --quick``: a real 4-rank engine run (sparse groups of 2) logs the engine's collectives —
the sparse groups' routing and row / gradient All2Alls, the prefetch thread's lookups, the replica sync,
the async dense all-reduce and its wait — and the command prints the promised JSON from them."""

import json

import pytest
import torch

from grstack.runtime.cli import main

pytestmark = pytest.mark.integration

FIELDS = {"kind", "workers", "scaling_efficiency", "published", "rows", "events_per_step", "events_per_step_note",
          "network_model", "compute_model", "byte_scaling", "union_of_touched_rows", "logged_run", "sensitivity",
          "rests_most_on", "not_modelled"}


def test_simulate_quick_logs_the_engines_collectives_and_prints_the_model(capsys, tmp_path):
    saved = tmp_path / "log.pt"
    assert main(["bench", "simulate", "--quick", "--workers", "128,1536", "--save-log", str(saved)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == FIELDS and out["kind"] == "model, not a measurement"
    assert out["published"]["scaling_efficiency"] == 0.9407 and out["published"]["workers"] == 1536
    assert [r["workers"] for r in out["rows"]] == [128, 1536] and out["rows"][0]["scaling_efficiency"] == 1.0
    assert 0 < out["scaling_efficiency"] == out["rows"][-1]["scaling_efficiency"] <= 1.0 + 1e-9
    for r in out["rows"]:
        assert r["step_ms"] >= r["compute_ms"] > 0 and r["exposed_comm_ms"] >= 0
    assert set(out["network_model"]["formulas"]) >= {"all_to_all", "all_reduce", "all_gather", "host"}
    assert out["rests_most_on"].split(":")[0] in out["sensitivity"]
    for ev in out["events_per_step"]:
        assert ev["thread"] in {"main", "comm", "prefetch"} and 0 <= ev["exposed_ms"] <= ev["ms"] + 1e-9
    check = out["union_of_touched_rows"]["check_against_logged_key_sets"]
    assert check[0]["model"] == pytest.approx(check[0]["measured"], rel=1e-3)

    # the log itself: every rank, every step, the engine's collectives with consistent byte counts
    ranks = torch.load(saved, weights_only=False)["ranks"]
    assert len(ranks) == 4
    for r in ranks:
        seen = {(e["op"], e["group"], e["thread"].split("_")[0]) for e in r["events"]}
        assert seen >= {("exchange", "sparse-pre", "grstack-prefetch"), ("all_to_all", "sparse-pre", "grstack-prefetch"),
                        ("all_to_all", "sparse-fwd", "grstack-comm"), ("all_reduce", "replica", "grstack-comm"),
                        ("all_reduce", "world", "grstack-comm"), ("wait", "world", "MainThread")}
        # the replica union: the largest key count, then gathered keys or a presence mask
        union_ops = {(e["op"], e["dtype"]) for e in r["events"] if e["group"] == "replica"}
        assert ("all_reduce", "int64") in union_ops and union_ops & {("all_gather", "int64"), ("all_reduce", "uint8")}
        for e in r["events"]:
            assert e["group_size"] == (4 if e["group"] == "world" else 2)
            if e["op"] == "all_to_all":  # rows of d=64 fp32 (or int64 keys): sent + own share = input
                row = e["nbytes"] // max(1, sum(e["split"]))
                assert e["sent"] == row * (sum(e["split"]) - e["split"][r["rank"] % 2])
            if e["op"] == "all_reduce" and e["group"] == "world":  # the stats, or a bucket of the dense gradients
                assert e["nbytes"] == 4 * (4 + 4) or e["nbytes"] > 4 * 1000
        # rows and gradients: per step, two All2Alls per lookup unit, as the engine's task order says
        for s, stats in enumerate(r["stats"]):
            comm = [e for e in r["events"] if e["step"] == s and e["thread"].startswith("grstack-comm")
                    and e["dtype"] == "float32" and e["op"] == "all_to_all"]
            assert len(comm) == 2 * len(stats["unit_events"])
