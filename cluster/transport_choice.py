"""Which kvtransfer transport carries a page set between two instances (pure policy, no Ray).

    kv_transport   same Ray node   different nodes
    auto           shm             tcp
    tcp            tcp             tcp
    shm            shm             shm   (refused by the receiver: the ring is a /dev/shm file)

Shared memory moves the bytes through one ring per sender→receiver pair in ``/dev/shm``
(about twice loopback TCP's throughput on a 2-core box, docs/kvtransfer.md); it only works when
both processes see the same ``/dev/shm``, i.e. share a node.
"""
from __future__ import annotations

AUTO, TCP, SHM = "auto", "tcp", "shm"
MODES = (AUTO, TCP, SHM)


def pair_transport(mode: str, src_node: str, dst_node: str) -> str:
    """``"shm"`` or ``"tcp"`` for a page set from an instance on ``src_node`` to one on ``dst_node``."""
    if mode not in MODES:
        raise ValueError(f"kv_transport: expected one of {', '.join(MODES)}, got {mode!r}")
    if mode == AUTO:
        return SHM if src_node and src_node == dst_node else TCP
    return mode
