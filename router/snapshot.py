"""What the router sees of the cluster: frozen, plain-data snapshots of pools and instances.

The cluster builds a snapshot from its membership table and the load it tracks, hands it to a
policy, and executes the placement the policy returns. Policies never call back into the cluster.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

# Pool names are part of the user-facing configuration; each maps to one engine role.
PREFILL = "prefill"
SHORT_DECODE = "short_decode"
LONG_DECODE = "long_decode"
MIXED = "mixed"
POOL_NAMES = (PREFILL, SHORT_DECODE, LONG_DECODE, MIXED)
POOL_ROLES = {PREFILL: "prefill", SHORT_DECODE: "decode", LONG_DECODE: "decode", MIXED: "mixed"}

# Instance lifecycle states (the Admin API's InstanceState without the prefix).
STARTING = "starting"
SERVING = "serving"
DRAINING = "draining"
STOPPED = "stopped"
DEAD = "dead"


@dataclass(frozen=True)
class InstanceSnapshot:
    instance_id: str
    pool: str
    state: str = SERVING
    # Engine-reported (may be a few hundred milliseconds old).
    num_waiting: int = 0
    num_running: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    # Frontend-tracked (exact): requests / branches placed here and not yet finished or moved.
    assigned_requests: int = 0
    assigned_branches: int = 0

    @property
    def serving(self) -> bool:
        return self.state == SERVING

    @property
    def kv_usage(self) -> float:
        if self.num_total_blocks <= 0:
            return 0.0
        return 1.0 - self.num_free_blocks / self.num_total_blocks


@dataclass(frozen=True)
class PoolSnapshot:
    name: str
    instances: tuple[InstanceSnapshot, ...] = ()

    @property
    def role(self) -> str:
        return POOL_ROLES[self.name]

    def serving(self) -> tuple[InstanceSnapshot, ...]:
        return tuple(i for i in self.instances if i.serving)


@dataclass(frozen=True)
class ClusterSnapshot:
    pools: tuple[PoolSnapshot, ...] = ()

    def pool(self, name: str) -> PoolSnapshot:
        for p in self.pools:
            if p.name == name:
                return p
        return PoolSnapshot(name)

    def instances(self) -> Iterator[InstanceSnapshot]:
        for p in self.pools:
            yield from p.instances

    def instance(self, instance_id: str) -> InstanceSnapshot | None:
        for i in self.instances():
            if i.instance_id == instance_id:
                return i
        return None
