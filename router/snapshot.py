"""What the router sees of the cluster: frozen, plain-data snapshots of pools and instances.

The cluster builds a snapshot from its membership table and the load it tracks, hands it to a
policy, and executes the placement the policy returns. Policies never call back into the cluster.
"""
from __future__ import annotations

import math
from bisect import bisect_left, insort
from dataclasses import dataclass, field
from functools import cached_property
from itertools import repeat
from operator import add, attrgetter, sub, truediv
from typing import Iterator, Mapping

# Pool names are part of the user-facing configuration; each maps to one engine role.
PREFILL = "prefill"
SHORT_DECODE = "short_decode"
LONG_DECODE = "long_decode"
MIXED = "mixed"
POOL_NAMES = (PREFILL, SHORT_DECODE, LONG_DECODE, MIXED)
POOL_ROLES = {PREFILL: "prefill", SHORT_DECODE: "decode", LONG_DECODE: "decode", MIXED: "mixed"}
# The pools a prompt can prefill in: the only holders whose prefix cache placement weighs.
PREFILL_POOLS = (PREFILL, MIXED)

# Instance lifecycle states (the Admin API's InstanceState without the prefix).
STARTING = "starting"
SERVING = "serving"
DRAINING = "draining"
STOPPED = "stopped"
DEAD = "dead"

# ``InstanceSnapshot.free_slots`` of an instance whose batch cap is unknown (``max_num_seqs`` 0).
UNBOUNDED_SLOTS = 1 << 30


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
    max_num_seqs: int = 0            # its engine's batch cap (0: unknown, taken as unbounded)

    @property
    def serving(self) -> bool:
        return self.state == SERVING

    @property
    def batch(self) -> int:
        """Branches in its batch or placed there (not yet arrived), whichever is more."""
        return max(self.num_running_seqs, self.assigned_branches)

    @property
    def free_slots(self) -> int:
        """Batch slots left under ``max_num_seqs`` (0 when full or above it: the engine admits
        no more, ``Scheduler.reserve_import`` holds an import until one frees); ``UNBOUNDED_SLOTS``
        when the cap is unknown."""
        if self.max_num_seqs <= 0:
            return UNBOUNDED_SLOTS
        return max(0, self.max_num_seqs - self.batch)

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
        return self.index.serving

    @cached_property
    def index(self) -> "ServingIndex":
        """What placement reads of this pool, built once per snapshot (a snapshot is immutable)."""
        return ServingIndex(self.instances)

    def replacing(self, updates: dict[int, InstanceSnapshot]) -> "PoolSnapshot":
        """This pool with the instances at the given positions replaced (same ids). When all of
        the pool and the replacements serve, the placement index already built on this snapshot
        is carried over with only those positions' columns recomputed, so one instance's new stats
        cost O(1) Python work plus C-level list copies rather than rebuilding every column."""
        insts = list(self.instances)
        serving = True
        for k, inst in updates.items():
            insts[k] = inst
            serving = serving and inst.state == SERVING
        new = PoolSnapshot(self.name, tuple(insts))
        old = self.__dict__.get("index")
        if serving and old is not None and old.serving is self.instances:
            new.__dict__["index"] = old.patched(new.instances, updates)
        return new


class ServingIndex:
    """A pool's serving instances as flat per-instance columns, so that a placement decision over
    hundreds of instances runs in C-level passes (``map``, ``max``) instead of a Python loop:

        headroom[k] = free − reserved blocks      batch[k] = max(running seqs, assigned branches)
        slots[k]    = max_num_seqs − batch[k], at least 0 (``InstanceSnapshot.free_slots``)

    An instance whose batch is full (no slot) is not a target while another has one: ``freest``
    skips it. Positions ``k`` follow ``serving`` (the cluster lists instances by id): ties go to the first.
    Built with C-level passes too, since the frontend builds a snapshot per decision."""

    __slots__ = ("serving", "_headroom", "_batch", "_batch1", "_least_queued", "_position", "_by_node", "_queue_order",
                 "_slots", "_cap", "_max_batch")

    def __init__(self, instances: tuple[InstanceSnapshot, ...]):
        states = list(map(_state, instances))
        self.serving = instances if states.count(SERVING) == len(states) else \
            tuple([i for i, st in zip(instances, states) if st == SERVING])
        # Columns are built on first use: a prefill pool needs only its queues, a decode pool
        # only headroom and batch.
        self._headroom = self._batch = self._batch1 = self._least_queued = None
        self._position = self._by_node = self._queue_order = None
        self._slots = self._cap = self._max_batch = None

    def patched(self, instances: tuple[InstanceSnapshot, ...], updates: dict[int, InstanceSnapshot]) -> "ServingIndex":
        """The index of ``instances`` (every one serving, this index's with ``updates`` at those
        positions, ids unchanged): built columns are copied and patched where they changed."""
        new = ServingIndex.__new__(ServingIndex)
        new.serving = instances
        new._position = self._position                  # same ids at the same positions
        new._headroom = new._batch = new._batch1 = new._slots = new._max_batch = None
        # the common cap carries over while every replaced instance reports it (known: not -1)
        cap = self._cap
        if cap is not None and cap >= 0:
            for i in updates.values():
                if i.max_num_seqs != cap:
                    cap = None
                    break
        else:
            cap = None
        new._cap = cap
        old, by_node, least = self.serving, self._by_node, self._least_queued
        if least is not None and least >= 0:
            # Every instance not replaced queues at least the old least-queued one's tokens (and
            # more if listed before it): unless that one's queue grew, the new least is it or a
            # replaced one, and no pass over the pool is needed.
            if least in updates and _queued(updates[least]) > _queued(old[least]):
                least = None
            else:
                lowest = _queued(instances[least])
                for k, i in updates.items():
                    q = _queued(i)
                    if q < lowest or (q == lowest and k < least):
                        least, lowest = k, q
        new._least_queued = least
        for k, i in updates.items():
            if by_node is not None and i.node_id != old[k].node_id:
                by_node = None
        new._by_node = by_node
        new._queue_order = order = self._queue_order
        if order is not None:
            # the replaced entries moved in the order: found and re-inserted by bisection (the
            # list copy is one C-level memmove), not re-sorted
            order = new._queue_order = order.copy()
            for k, i in updates.items():
                del order[bisect_left(order, (_queued(old[k]), k))]
                insort(order, (_queued(i), k))
        positions, replaced = tuple(updates), tuple(updates.values())
        if self._headroom is not None:
            new._headroom = h = self._headroom.copy()
            for k, v in zip(positions, _headroom_column(replaced)):
                h[k] = v
        if self._batch is not None:
            old_b, top = self._batch, self._max_batch
            new._batch = b = old_b.copy()
            for k, v in zip(positions, _batch_column(replaced)):
                if top is not None and v < top == old_b[k]:
                    top = None                  # the largest batch may have shrunk: recount on use
                elif top is not None and v > top:
                    top = v
                b[k] = v
            new._max_batch = top
            if self._batch1 is not None:
                new._batch1 = b1 = self._batch1.copy()
                for k in positions:
                    b1[k] = b[k] + 1
            if self._slots is not None:
                new._slots = sl = self._slots.copy()
                for k, v in zip(positions, _slots_column(replaced, [b[k] for k in positions])):
                    sl[k] = v
        return new

    @property
    def headroom(self) -> list[int]:
        if self._headroom is None:
            self._headroom = _headroom_column(self.serving)
        return self._headroom

    @property
    def batch(self) -> list[int]:
        if self._batch is None:
            self._batch = _batch_column(self.serving)
        return self._batch

    @property
    def slots(self) -> list[int]:
        """Free batch slots per instance (``InstanceSnapshot.free_slots``)."""
        if self._slots is None:
            self._slots = _slots_column(self.serving, self.batch)
        return self._slots

    @property
    def cap(self) -> int:
        """The batch cap (``max_num_seqs``) every serving instance reports: 0 when none reports
        one, -1 when they differ (a pool's instances share one engine config, so rarely)."""
        if self._cap is None:
            caps = list(map(_max_num_seqs, self.serving))
            c = caps[0] if caps else 0
            self._cap = c if caps.count(c) == len(caps) else -1
        return self._cap

    def all_have_room(self, n: int) -> bool:
        """Whether every serving instance has ``n`` free batch slots or more: with one common cap
        a comparison against the largest batch, so the usual case builds no slots column."""
        cap = self.cap
        if cap == 0:
            return True
        if cap > 0:
            if self._max_batch is None:
                self._max_batch = max(self.batch, default=0)
            return self._max_batch + n <= cap
        return min(self.slots, default=n) >= n

    def has_room(self, n: int) -> bool:
        """Whether the pool's free batch slots, together, take ``n`` branches."""
        if self.all_have_room(n):
            return bool(self.serving)
        return sum(self.slots) >= n             # slots are >= 0: one instance's n count here too

    @property
    def least_queued(self) -> int:
        """Position of the first instance with the fewest queued prefill tokens (-1: none)."""
        if self._least_queued is None:
            queued = list(map(_queued, self.serving))
            self._least_queued = queued.index(min(queued)) if queued else -1
        return self._least_queued

    @property
    def queue_order(self) -> list[tuple[int, int]]:
        """(queued prefill tokens, position) of every instance, ascending: built on first use and
        carried through ``patched``, so a placement that must skip some instances finds the least
        queued of the rest in as many steps as it skips."""
        if self._queue_order is None:
            self._queue_order = sorted(zip(map(_queued, self.serving), range(len(self.serving))))
        return self._queue_order

    def least_queued_outside(self, taken: set[int]) -> int:
        """Position of the first instance with the fewest queued prefill tokens that is not in
        ``taken`` (-1: none)."""
        for _, k in self.queue_order:
            if k not in taken:
                return k
        return -1

    @property
    def position(self) -> dict[str, int]:
        """instance id -> position (built on first use: only prefix hits need it)."""
        if self._position is None:
            self._position = dict(zip(map(_instance_id, self.serving), range(len(self.serving))))
        return self._position

    @property
    def by_node(self) -> dict[str, list[int]]:
        """node id -> positions of its instances (built on first use)."""
        if self._by_node is None:
            self._by_node = {}
            for k, i in enumerate(self.serving):
                self._by_node.setdefault(i.node_id, []).append(k)
        return self._by_node

    def freeness(self, need: int) -> list[float]:
        """Llumnix freeness (headroom − need) / (batch + 1) of every instance, by position."""
        if self._batch1 is None:
            self._batch1 = list(map(add, self.batch, repeat(1)))
        return list(map(truediv, map(sub, self.headroom, repeat(need)), self._batch1))

    def freest(self, need: int) -> int:
        """Position of the instance with the highest Llumnix freeness (headroom − need) / (batch + 1)
        among those with a free batch slot (all of them when none has one: the work queues at the
        freest); ties go to the smaller batch, then the first listed."""
        f = self.freeness(need)
        if not self.all_have_room(1):
            slots = self.slots
            if max(slots) > 0:
                f = list(map(_unless_full, f, slots))
        top = max(f)
        k = f.index(top)
        if f.count(top) > 1:
            batch = self.batch
            k = min((k2 for k2, x in enumerate(f) if x == top), key=lambda k2: (batch[k2], k2))
        return k


NO_HOLDERS: frozenset[str] = frozenset()
NOT_HELD: tuple[frozenset[str], frozenset[str]] = (NO_HOLDERS, NO_HOLDERS)


@dataclass(frozen=True)
class PrefixIndex:
    """Where a prompt's KV blocks are cached, by block hash (the chained hashes of
    ``workers/block_hash.py``, so a prompt's i-th hash names its whole prefix up to block i).

    ``blocks[h] = (instances, nodes)``: the instances whose device prefix cache holds block ``h``
    and the nodes whose CPU KV store holds it (either may be empty, never both). One table for
    both kinds of holder, so a placement looks each of the prompt's blocks up once (``hits``).
    Read-only once built."""

    blocks: Mapping[int, tuple[frozenset[str], frozenset[str]]] = field(default_factory=dict)

    @classmethod
    def merged(cls, on_instance: Mapping[int, frozenset[str]] = {},
               in_store: Mapping[int, frozenset[str]] = {}) -> "PrefixIndex":
        """The index of two per-kind tables (block hash -> instances; block hash -> nodes)."""
        blocks = {h: (held, NO_HOLDERS) for h, held in on_instance.items() if held}
        for h, nodes in in_store.items():
            if nodes:
                blocks[h] = (blocks.get(h, NOT_HELD)[0], nodes)
        return cls(blocks)

    def hits(self, hashes: tuple[int, ...]) -> tuple[dict[str, int], dict[str, int]]:
        """(instance id -> number of leading blocks of ``hashes`` its device holds; node id ->
        number of leading blocks its CPU store holds), holders with none omitted."""
        blocks = self.blocks
        if not hashes or not blocks:
            return {}, {}
        first = blocks.get(hashes[0])
        if first is None:
            return {}, {}
        # The lookups run in C (``map``); a cached chain's blocks usually have equal holders, and
        # then ``count`` (identity, then equality) settles the whole chain without a Python loop.
        held = list(map(blocks.get, hashes))
        n = len(held)
        if held.count(first) == n:
            return dict.fromkeys(first[0], n), dict.fromkeys(first[1], n)
        return _leading_hits(first[0], held, 0), _leading_hits(first[1], held, 1)


def _leading_hits(alive: frozenset[str], held: list, side: int) -> dict[str, int]:
    """Holder -> leading blocks held, for one kind of holder (``side`` of each entry of ``held``,
    the looked-up blocks in order; ``alive``: that side of the first block). Blocks are chained:
    a holder counts block i only if it counted every block before it."""
    hits: dict[str, int] = {}
    if not alive:
        return hits
    n = len(held)
    for i, entry in enumerate(held):
        if entry is None:
            n = i
            break
        holders = entry[side]
        if holders is alive or alive <= holders:
            continue
        still = alive & holders                 # someone's chain ends here
        for k in alive - still:
            hits[k] = i
        alive = still
        if not alive:
            return hits
    for k in alive:
        hits[k] = n
    return hits


@dataclass(frozen=True)
class ClusterSnapshot:
    pools: tuple[PoolSnapshot, ...] = ()
    prefix: PrefixIndex = PrefixIndex()

    def pool(self, name: str) -> PoolSnapshot:
        # Pools by name, built on first use and kept in the instance dict by hand: a
        # ``cached_property`` takes a lock on first access (Python 3.11), several times the cost
        # of building four entries, and the frontend makes a new snapshot per poll that landed.
        by_name = self.__dict__.get("_by_name")
        if by_name is None:
            by_name = {}
            for p in self.pools:
                by_name.setdefault(p.name, p)       # the first of a name, as a scan would find
            self.__dict__["_by_name"] = by_name
        p = by_name.get(name)
        return PoolSnapshot(name) if p is None else p

    def with_prefix(self, prefix: PrefixIndex) -> "ClusterSnapshot":
        """This snapshot with ``prefix`` as its index, keeping the pool lookup already built on it
        (what ``dataclasses.replace`` would rebuild, at several times the cost, every decision)."""
        new = ClusterSnapshot(self.pools, prefix)
        by_name = self.__dict__.get("_by_name")
        if by_name is not None:
            new.__dict__["_by_name"] = by_name
        return new

    def instances(self) -> Iterator[InstanceSnapshot]:
        for p in self.pools:
            yield from p.instances

    def instance(self, instance_id: str) -> InstanceSnapshot | None:
        for i in self.instances():
            if i.instance_id == instance_id:
                return i
        return None


_state, _free, _reserved = attrgetter("state"), attrgetter("num_free_blocks"), attrgetter("reserved_blocks")
_running_seqs, _assigned_branches = attrgetter("num_running_seqs"), attrgetter("assigned_branches")
_queued, _instance_id = attrgetter("queued_prefill_tokens"), attrgetter("instance_id")
_max_num_seqs = attrgetter("max_num_seqs")


def _headroom_column(insts) -> list[int]:
    """Free blocks less reserved ones, per instance (C-level passes; also patches an index)."""
    return list(map(sub, map(_free, insts), map(_reserved, insts)))


def _slots_column(insts, batch: list[int]) -> list[int]:
    """Free batch slots per instance (``InstanceSnapshot.free_slots``) given its batch column."""
    caps = list(map(_max_num_seqs, insts))
    unknown = caps.count(0)
    if unknown == len(caps):
        return [UNBOUNDED_SLOTS] * len(caps)
    if unknown:
        caps = [c if c > 0 else UNBOUNDED_SLOTS + b for c, b in zip(caps, batch)]
    return list(map(max, map(sub, caps, batch), repeat(0)))


def _unless_full(freeness: float, slots: int) -> float:
    return freeness if slots > 0 else -math.inf


def _batch_column(insts) -> list[int]:
    """Running sequences or branches placed there, whichever is more, per instance."""
    return list(map(max, map(_running_seqs, insts), map(_assigned_branches, insts)))
