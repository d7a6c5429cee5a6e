"""Typed messages between the cluster's actors (instances, controller, frontend).

Plain frozen dataclasses of ints, strings and tuples. They cross process boundaries only through
Ray's own object transport inside the cluster; nothing here is read from a network port.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from thinkserve.router.snapshot import InstanceSnapshot


@dataclass(frozen=True)
class BranchDelta:
    """New output tokens of one branch. ``start`` is the branch's output length before them, so a
    receiver can place them exactly (and drop a repeat after a move)."""

    index: int
    start: int
    token_ids: tuple[int, ...]
    finish_reason: str | None = None   # "stop" | "length" | "abort" once finished


@dataclass(frozen=True)
class PartDelta:
    """What one engine step did for one *part* (an engine-level request: the branches of a user
    request that live on this instance)."""

    part_id: str
    branches: tuple[BranchDelta, ...]
    prefilled: bool = False           # prefill role: prompt computed, waiting to be exported
    finished: bool = False            # every branch of the part finished; the engine freed it


@dataclass(frozen=True)
class InstanceStats:
    instance_id: str
    num_waiting: int = 0
    num_running: int = 0
    num_swapped: int = 0
    num_held: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    generated_tokens: int = 0
    num_parts: int = 0
    admitting: bool = True
    steps: int = 0
    prefix_cache_hit_rate: float = 0.0   # the engine's: hit blocks / looked-up full prompt blocks
    store_prefix_blocks: int = 0      # blocks loaded from the CPU store into the prefix cache before a prefill
    num_preemptions: int = 0          # the engine's, since it started: swapped out + recomputed
    num_recompute_preemptions: int = 0


@dataclass(frozen=True)
class PollResult:
    deltas: tuple[PartDelta, ...]
    stats: InstanceStats


@dataclass(frozen=True)
class InstanceInfo:
    """What an instance reports once its weights are loaded."""

    instance_id: str
    pool: str
    role: str
    node_id: str
    kv_address: str                   # where peers send it page sets (kvtransfer TCP endpoint)
    num_total_blocks: int
    block_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    shm_address: str = ""             # its same-node shared-memory endpoint ("" when kv_transport is tcp)
    store_address: str = ""           # the CPU KV store of its node ("" when it has none)

    def kv_endpoint(self, transport: str) -> str:
        return self.shm_address if transport == "shm" else self.kv_address


@dataclass(frozen=True)
class Admission:
    ok: bool
    reason: str = ""                  # "draining" | "duplicate" | "invalid: ..." when not ok


@dataclass
class Member:
    """The controller's record of one instance (the handle travels to the frontend)."""

    instance_id: str
    pool: str
    state: str
    handle: object = field(repr=False, default=None)
    info: InstanceInfo | None = None
    created_at: float = 0.0
    error: str = ""

    def snapshot(self, stats: InstanceStats | None, assigned_requests: int = 0,
                 assigned_branches: int = 0) -> InstanceSnapshot:
        s = stats or InstanceStats(self.instance_id)
        return InstanceSnapshot(self.instance_id, self.pool, self.state, s.num_waiting, s.num_running,
                                s.num_free_blocks, s.num_total_blocks, assigned_requests, assigned_branches)


@dataclass(frozen=True)
class StoreInfo:
    """One node's CPU KV store (``KVStoreActor``)."""

    node_id: str
    address: str
    handle: object = field(repr=False, default=None, compare=False)


@dataclass(frozen=True)
class Membership:
    version: int
    members: tuple[Member, ...]
    targets: tuple[tuple[str, int], ...]   # (pool, target replicas)
    stores: tuple[StoreInfo, ...] = ()     # one per node
