"""In every pipeline mode, on 2 gloo ranks: each communicator is issued by one thread and the device
communicators' collectives come in the same order on both ranks (what NCCL/HCCL need not to deadlock); a
step reads the device back once (the stats); and each tensor that crosses lanes is used only after the lane
that uses it waited for the marker of the work that produced it.

The host-read count is the CPU counter's (``device.host_sync_counter``: on CPU the aten operators and
reads that would block the host on a device, in the training thread). Reads inside the model's forward and
inside the table optimizer are attributed separately, so a regression names where it came from: the models
plan attention from host lengths and both optimizers are fused (their step counts stay on the device), so
neither reads anything back."""

from pathlib import Path

import pytest
from grstack_dist_workers import DIST_ENV
from grstack_testing import tiny_config_args, write_cyclic

from grstack.runtime.train.collective_audit import audit_collectives
from grstack.runtime.train.issue_queue import THREAD_NAME
from grstack.runtime.train.launch import call_ranks
from grstack.runtime.training_config import load_config

pytestmark = pytest.mark.integration

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "synthetic-tiny-hstu.yaml"
MODES = {
    "sync": {},
    "dbp": {"pipeline.dbp": True},
    "fwp": {"pipeline.microbatches": 3},
    "fwp_clustered": {"pipeline.microbatches": 3, "pipeline.cluster": True},
    "semi_async": {"pipeline.semi_async": True, "optim.grad_clip": 1.0},
}
DEVICE_GROUPS = ("world", "sparse-fwd", "replica")


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    data = write_cyclic(tmp_path_factory.mktemp("data") / "cyclic")
    return load_config(CONFIG, [*tiny_config_args(data), "model.dropout=0", "model.input_dropout=0"])


@pytest.fixture(scope="module")
def logged(cfg):
    return call_ranks("grstack.runtime.train.harness:run_modes", 2,
                      {"config": cfg.model_dump(mode="json"), "modes": MODES, "steps": 5, "comm_log": True,
                       "params": False}, limit_s=120)


@pytest.fixture(scope="module")
def counted(cfg):
    return call_ranks("grstack_pipeline_workers:counted_steps", 2,
                      {"config": cfg.model_dump(mode="json"), "modes": MODES, "steps": 4}, limit_s=120,
                      env=DIST_ENV)


@pytest.mark.parametrize("mode", MODES)
def test_one_issuing_thread_per_communicator_and_one_order_on_every_rank(logged, mode):
    logs = [rank[mode]["comm_log"] for rank in logged]
    got = audit_collectives(logs, members=[rank[mode]["comm_groups"] for rank in logged], meta_inline=True)
    assert got["order_violations"] == 0, got["device_order"]
    assert got["issuing_threads_per_communicator_max"] == 1
    for events in logs:
        device = [e for e in events if e["group"] in DEVICE_GROUPS and e["op"] != "wait"]
        assert device and {e["thread"] for e in device} == {THREAD_NAME}
        # the host group of the prefetch carries host data only (on NCCL/HCCL it is a gloo group)
        assert all(not e["dtype"].startswith("float") for e in events if e["group"] == "sparse-pre")
    # the device sequences themselves, compared directly as well
    seqs = [[(e["group"], e["op"]) for e in sorted(events, key=lambda e: e["start"])
             if e["group"] in DEVICE_GROUPS and e["op"] != "wait"] for events in logs]
    assert seqs[0] == seqs[1]
    if mode == "semi_async":  # the rows All2All left the prefetch thread for the issuing one
        assert any(e["op"] == "all_to_all" and e["dtype"].startswith("float") and e["group"] == "sparse-fwd"
                   for e in logs[0])


@pytest.mark.parametrize("mode", MODES)
def test_a_step_reads_the_device_back_once(counted, mode):
    for rank in counted:
        steps = rank[mode]["steps"]
        assert len(steps) == 4
        for total, in_model, in_table, counter in steps:
            assert "upper bound" in counter  # the CPU counter (grstack.kernels.HostSyncCount), labelled so
            assert (in_model, in_table) == (0, 0)
            assert total == 1  # the stats, after the update


@pytest.mark.parametrize("mode", MODES)
def test_tensors_cross_lanes_only_after_a_wait_for_their_producer(counted, mode):
    trace = counted[0][mode]["trace"]
    recorded: dict[int, str] = {}
    waited: dict[int, list[str]] = {}
    for lane, op, marker in trace:
        if op == "record":
            recorded[marker] = lane
        elif op == "wait" and marker is not None:
            assert marker in recorded, f"{lane} waits for marker {marker} before it was recorded"
            waited.setdefault(marker, []).append(lane)
    comm = [m for m, lane in recorded.items() if lane == "comm"]
    copy = [m for m, lane in recorded.items() if lane == "copy"]
    assert comm
    # every result of the issuing thread (rows, gradient sends, all-reduces) is waited for by the compute
    # lane before use, except the last semi-async prefetch's parked rows (dropped by drain)
    unwaited = [m for m in comm if "compute" not in waited.get(m, [])]
    assert len(unwaited) <= (1 if mode == "semi_async" else 0)
    if mode in ("dbp", "semi_async"):
        assert copy
        # the prefetch's retrieve (copy lane) is waited for before the buffer is used ...
        assert all("compute" in waited.get(m, []) for m in copy[:-1])
        # ... and it read the table after the previous update (a compute marker)
        copy_waits = [m for lane, op, m in trace if lane == "copy" and op == "wait" and m is not None]
        assert copy_waits and all(recorded[m] == "compute" for m in copy_waits)
    else:
        assert not copy
