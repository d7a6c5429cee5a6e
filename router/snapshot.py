"""What the router sees of the cluster: frozen, plain-data snapshots of pools and instances.

The cluster builds a snapshot from its membership table and the load it tracks, hands it to a
policy, and executes the placement the policy returns. Policies never call back into the cluster.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Mapping

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
    # For cost-aware placement (the Conductor); the defaults describe an idle instance.
    queued_prefill_tokens: int = 0   # prompt tokens admitted here and not yet computed
    block_size: int = 16
    node_id: str = ""                # its node: prefix hits in that node's CPU store count for it
    reserved_blocks: int = 0         # frontend-tracked: blocks its running branches are predicted to still need
    num_running_seqs: int = 0        # branches in its batch (the B of Llumnix freeness)

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
        return tuple([i for i in self.instances if i.state == SERVING])


@dataclass(frozen=True)
class PrefixIndex:
    """Where a prompt's KV blocks are cached, by block hash (the chained hashes of
    ``workers/block_hash.py``, so a prompt's i-th hash names its whole prefix up to block i).

    ``on_instance[h]``: instances whose device prefix cache holds block ``h``;
    ``in_store[h]``: nodes whose CPU KV store holds it. Read-only once built."""

    on_instance: Mapping[int, frozenset[str]] = field(default_factory=dict)
    in_store: Mapping[int, frozenset[str]] = field(default_factory=dict)

    def instance_hits(self, hashes: tuple[int, ...]) -> dict[str, int]:
        """instance id -> number of leading blocks of ``hashes`` it holds (instances with none omitted)."""
        return _leading_hits(self.on_instance, hashes)

    def store_hits(self, hashes: tuple[int, ...]) -> dict[str, int]:
        """node id -> number of leading blocks of ``hashes`` its CPU store holds."""
        return _leading_hits(self.in_store, hashes)


def _leading_hits(index: Mapping[int, frozenset[str]], hashes: tuple[int, ...]) -> dict[str, int]:
    # Blocks are chained: a holder counts block i only if it counted every block before it.
    if not hashes or not index:
        return {}
    alive = index.get(hashes[0])
    if not alive:
        return {}
    hits: dict[str, int] = {}
    n = 1
    for h in hashes[1:]:
        holders = index.get(h)
        if holders is None:
            break
        if not alive <= holders:            # someone's chain ends here
            still = alive & holders
            for k in alive - still:
                hits[k] = n
            alive = still
            if not alive:
                break
        n += 1
    for k in alive:
        hits[k] = n
    return hits


@dataclass(frozen=True)
class ClusterSnapshot:
    pools: tuple[PoolSnapshot, ...] = ()
    prefix: PrefixIndex = PrefixIndex()

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
