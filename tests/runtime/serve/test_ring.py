"""Consistent hashing with bounded load: stable, balanced, minimal movement, load-bounded."""

from __future__ import annotations

from collections import Counter

import pytest

from grstack.runtime.serve.ring import HashRing

pytestmark = pytest.mark.unit


def test_order_is_a_stable_permutation() -> None:
    ring = HashRing(["a", "b", "c"])
    for user in ("u1", "u2", "u3"):
        order = ring.order(user)
        assert sorted(order) == ["a", "b", "c"]
        assert HashRing(["c", "a", "b"]).order(user) == order  # same on every router
    assert HashRing().order("u") == [] and HashRing().choose("u") is None


def test_balance_and_minimal_movement() -> None:
    users = [f"user-{i}" for i in range(3000)]
    three = HashRing(["a", "b", "c"])
    owners = {u: three.choose(u) for u in users}
    counts = Counter(owners.values())
    assert min(counts.values()) > 0.7 * len(users) / 3
    four = HashRing(["a", "b", "c", "d"])
    moved = [u for u in users if four.choose(u) != owners[u]]
    assert all(four.choose(u) == "d" for u in moved)  # only users taken over by the new replica move
    assert 0.1 * len(users) < len(moved) < 0.4 * len(users)


def test_bounded_load_skips_an_overloaded_replica() -> None:
    ring = HashRing(["a", "b"])
    first, second = ring.order("hot-user")
    assert ring.choose("hot-user", {first: 0, second: 0}) == first
    # cap = ceil(1.25 * (total + 1) / 2): with 4 in flight on `first` and 0 elsewhere, cap is 4 -> skip it
    assert ring.choose("hot-user", {first: 4, second: 0}) == second
    assert ring.choose("hot-user", {first: 2, second: 2}) == first
    assert ring.choose("hot-user", {}, exclude=[first]) == second
