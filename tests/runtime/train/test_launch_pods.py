"""Several local ranks per pod (GRTrainingJob ``nprocPerNode``): ``grstack train --nproc N`` inside a pod whose
torchrun environment is that of its local rank 0 (NODE_RANK, RANK = NODE_RANK * N, WORLD_SIZE = all ranks)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from grstack_testing import set_args, tiny_config_args, write_cyclic

from grstack.runtime.errors import UserError
from grstack.runtime.train.launch import Node, free_port, node_from_env, rank_env

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "synthetic-tiny-hstu.yaml"


def pod_env(node: int, nproc: int, pods: int, port: int = 29500) -> dict[str, str]:
    """What the operator gives pod ``node`` (see grstack.operator.training.worker_pod)."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(pods * nproc),
            "RANK": str(node * nproc), "NODE_RANK": str(node), "GROUP_RANK": str(node), "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": str(nproc)}


@pytest.mark.unit
def test_local_ranks_of_a_pod_get_global_ranks() -> None:
    assert node_from_env(2, {}) is None
    node = node_from_env(4, pod_env(2, 4, 3))
    assert node == Node("127.0.0.1", 29500, 12, 8)
    envs = [rank_env(r, 4, 0, node=node) for r in range(4)]
    assert [e["RANK"] for e in envs] == ["8", "9", "10", "11"]
    assert {e["WORLD_SIZE"] for e in envs} == {"12"} and [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"4"} and {e["NODE_RANK"] for e in envs} == {"2"}
    assert {e["MASTER_PORT"] for e in envs} == {"29500"}
    # GROUP_RANK alone (torchrun's name), or only RANK, also place the pod
    env = pod_env(1, 2, 2)
    del env["NODE_RANK"]
    assert node_from_env(2, env).base == 2
    del env["GROUP_RANK"]
    assert node_from_env(2, env).base == 2


@pytest.mark.unit
@pytest.mark.parametrize(("change", "needle"), [
    ({"LOCAL_WORLD_SIZE": "1"}, "LOCAL_WORLD_SIZE=1"),
    ({"RANK": "3"}, "is not NODE_RANK"),
    ({"WORLD_SIZE": "3"}, "do not fit"),
    ({"NODE_RANK": "5", "RANK": "10"}, "do not fit"),
    ({"MASTER_PORT": "x"}, "bad environment"),
])
def test_inconsistent_pod_environment_is_a_user_error(change: dict[str, str], needle: str) -> None:
    with pytest.raises(UserError, match=needle):
        node_from_env(2, {**pod_env(1, 2, 2), **change})


@pytest.mark.integration
def test_two_pods_of_two_ranks_train_as_one_job(tmp_path: Path) -> None:
    """Two 'pods' (processes with the operator's env) each run ``grstack train --nproc 2``: one 4-rank job."""
    data = write_cyclic(tmp_path / "cyclic", num_users=100)
    run = tmp_path / "run"  # the shared checkpoint volume
    argv = [sys.executable, "-P", "-m", "grstack.runtime.cli", "train", "--config", str(CONFIG), "--out", str(run),
            "--no-progress", "--json", "--nproc", "2",
            *set_args([*tiny_config_args(data), "train.epochs=1", "train.num_threads=1",
                       "distributed.timeout_s=60"])]
    port = free_port()
    procs = [subprocess.Popen(argv, env={**os.environ, **pod_env(n, 2, 2, port)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for n in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["distributed"]["world_size"] == 4
    assert json.loads(outs[0][0])["steps"] == summary["steps"]
