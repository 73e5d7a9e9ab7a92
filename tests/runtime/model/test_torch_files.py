"""What a grstack torch file may hold (tensors and plain values, so the restricted unpickler reads it back),
and the two digests: of a file's bytes and of its content."""

from __future__ import annotations

import enum

import numpy as np
import pytest
import torch

from grstack.runtime.model.torch_files import atomic_torch_save, content_sha256, file_sha256, plain

pytestmark = pytest.mark.unit


class Kind(enum.IntEnum):
    A = 3


def test_what_is_written_reads_back_through_the_restricted_unpickler(tmp_path):
    obj = {"w": torch.arange(4.0), "step": np.int64(7), "loss": np.float32(0.5), "kind": Kind.A,
           "betas": (0.9, 0.99), "shape": torch.Size([2, 2]), 0: [None, True, "x"]}
    path = tmp_path / "f.pt"
    digest = atomic_torch_save(obj, path)
    assert digest == file_sha256(path) and not list(tmp_path.glob(".f.pt.*"))
    back = torch.load(path, weights_only=True)
    assert back["step"] == 7 and type(back["step"]) is int and type(back["loss"]) is float
    assert back["kind"] == 3 and type(back["kind"]) is int and back["betas"] == (0.9, 0.99)
    assert content_sha256(back) == content_sha256(plain(obj))


def test_anything_else_fails_the_writer_not_a_later_reader(tmp_path):
    with pytest.raises(TypeError, match="ndarray"):
        atomic_torch_save({"keys": np.arange(3)}, tmp_path / "f.pt")
    assert not list(tmp_path.iterdir())
    with pytest.raises(TypeError, match="set"):
        plain({"s": {1, 2}})


def test_the_content_digest_sees_every_value_and_only_values():
    base = {"a": torch.tensor([1.0, 2.0]), "b": [1, "x"]}
    assert content_sha256(base) == content_sha256({"b": [1, "x"], "a": torch.tensor([1.0, 2.0])})
    for other in ({"a": torch.tensor([1.0, 2.5]), "b": [1, "x"]},
                  {"a": torch.tensor([1.0, 2.0], dtype=torch.float64), "b": [1, "x"]},
                  {"a": torch.tensor([[1.0, 2.0]]), "b": [1, "x"]},
                  {"a": torch.tensor([1.0, 2.0]), "b": [1.0, "x"]},
                  {"a": torch.tensor([1.0, 2.0]), "b": [1, "x"], "c": None}):
        assert content_sha256(other) != content_sha256(base)
