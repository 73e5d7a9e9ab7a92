"""``local_device``: each local rank's own accelerator; an explicit index is local rank 0's alone (ranks
started under torchrun with ``train.device=cuda:0`` would all share one GPU, which NCCL refuses mid-start)."""

import pytest
import torch

from grstack.runtime.device import local_device
from grstack.runtime.errors import UserError

pytestmark = pytest.mark.unit


@pytest.fixture
def four_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)


def test_a_kind_without_an_index_is_the_local_ranks_own(four_gpus):
    assert local_device(torch.device("cuda"), 0) == torch.device("cuda", 0)
    assert local_device(torch.device("cuda"), 3) == torch.device("cuda", 3)
    with pytest.raises(UserError, match=r"^LOCAL_RANK=4 needs a cuda device of its own"):
        local_device(torch.device("cuda"), 4)
    assert local_device(torch.device("cpu"), 5) == torch.device("cpu")


def test_an_explicit_index_belongs_to_local_rank_0_only(four_gpus):
    assert local_device(torch.device("cuda", 2), 0) == torch.device("cuda", 2)
    with pytest.raises(UserError, match=r"^train\.device=cuda:0 on LOCAL_RANK=1: each local rank takes its own "
                                        r"accelerator \(cuda:<local rank>\); use train\.device=cuda$"):
        local_device(torch.device("cuda", 0), 1)
    with pytest.raises(UserError, match=r"train\.device=cuda:3 on LOCAL_RANK=3: "):
        local_device(torch.device("cuda", 3), 3)  # even the index that rank would have taken: say cuda
