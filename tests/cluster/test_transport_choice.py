"""Which transport a page set takes between two instances (pure policy)."""
from __future__ import annotations

import pytest

from thinkserve.cluster.transport_choice import pair_transport


def test_auto_uses_shared_memory_only_within_a_node():
    assert pair_transport("auto", "node-a", "node-a") == "shm"
    assert pair_transport("auto", "node-a", "node-b") == "tcp"
    assert pair_transport("auto", "", "") == "tcp"          # unknown nodes: never assume one


def test_forced_modes_ignore_placement():
    for src, dst in (("a", "a"), ("a", "b")):
        assert pair_transport("tcp", src, dst) == "tcp"
        assert pair_transport("shm", src, dst) == "shm"
        assert pair_transport("collective", src, dst) == "collective"


def test_unknown_mode_names_the_field():
    with pytest.raises(ValueError, match="kv_transport"):
        pair_transport("rdma", "a", "a")
