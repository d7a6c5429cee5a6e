"""Which kvtransfer transport carries a page set between two instances (pure policy, no Ray).

    kv_transport   same Ray node   different nodes
    auto           shm             tcp
    tcp            tcp             tcp
    shm            shm             shm   (refused by the receiver: the ring is a /dev/shm file)
    collective     collective      collective (a gloo pair group per sender→receiver pair; NCCL when
                                              the instances' engines run on GPUs)

Shared memory moves the bytes through one ring per sender→receiver pair in ``/dev/shm``
(about twice loopback TCP's throughput on a 2-core box, docs/kvtransfer.md); it only works when
both processes see the same ``/dev/shm``, i.e. share a node.
"""
from __future__ import annotations

AUTO, TCP, SHM, COLLECTIVE = "auto", "tcp", "shm", "collective"
MODES = (AUTO, TCP, SHM, COLLECTIVE)


def pair_transport(mode: str, src_node: str, dst_node: str) -> str:
    """``"shm"``, ``"tcp"`` or ``"collective"`` for a page set from an instance on ``src_node`` to one on ``dst_node``."""
    if mode not in MODES:
        raise ValueError(f"kv_transport: expected one of {', '.join(MODES)}, got {mode!r}")
    if mode == AUTO:
        return SHM if src_node and src_node == dst_node else TCP
    return mode
