"""The frontend's view of the cluster: who serves, how loaded, where the stores are.

    controller ──Membership──▶ ClusterView.apply_membership ──▶ members, stores, draining
    instance pollers ──InstanceStats──▶ ClusterView.record_stats
    RequestTable (parts per instance) ─┐
                                       ├─▶ ClusterView.snapshot() ──▶ router policies
    members + stats + draining + lost ─┘

It owns the membership-derived state and nothing about requests; the load it reports per
instance (requests, branches) comes from the ``RequestTable`` it is given. Instance and store
handles are wrapped once (``wrap_instance`` / ``wrap_store``: the Ray adapters in production,
identity for in-process handles) so everything above awaits plain async methods.
"""
from __future__ import annotations

import asyncio
import operator
import time
from dataclasses import dataclass
from typing import Callable

from thinkserve.router import ClusterSnapshot, PoolSnapshot
from thinkserve.router.moves import first_target
from thinkserve.router.snapshot import DRAINING, POOL_NAMES, SERVING, InstanceSnapshot, PrefixIndex

from .instance_handle import InstanceHandle, StoreHandle
from .messages import InstanceStats, Member, Membership, StoreInfo
from .request_state import RequestTable
from .transport_choice import TCP, pair_transport


_instance_id = operator.attrgetter("instance_id")
# What an instance's snapshot reads of its stats (``Member.snapshot``): a poll that changed only
# other counters (tokens generated, steps, transfers) leaves its snapshot and its pool's as they were.
_snapshot_stats = operator.attrgetter("num_waiting", "num_running", "num_free_blocks", "num_total_blocks",
                                      "queued_prefill_tokens", "num_running_seqs")


class _TrackedDict(dict):
    """A dict that notes the keys written or removed (into ``dirty``), so the snapshot rebuilds
    only what changed instead of passing over every instance per decision."""

    __slots__ = ("dirty",)

    def __init__(self, dirty: set):
        super().__init__()
        self.dirty = dirty

    def __setitem__(self, key, value):
        self.dirty.add(key)
        dict.__setitem__(self, key, value)

    def __delitem__(self, key):
        self.dirty.add(key)
        dict.__delitem__(self, key)

    def pop(self, key, *default):
        self.dirty.add(key)
        return dict.pop(self, key, *default)

    def setdefault(self, key, default=None):
        self.dirty.add(key)
        return dict.setdefault(self, key, default)

    def update(self, *args, **kw):
        for k, v in dict(*args, **kw).items():
            self[k] = v

    def popitem(self):
        k, v = dict.popitem(self)
        self.dirty.add(k)
        return k, v

    def clear(self):
        self.dirty.update(self)
        dict.clear(self)


def _changed_keys(new: dict, old: dict) -> set:
    """Keys whose value differs between two dicts (C-level set passes)."""
    if new == old:
        return set()
    return {k for k, _ in new.items() ^ old.items()}


@dataclass(frozen=True)
class MembershipChange:
    """What ``apply_membership`` changed: instances to start polling, instances that left."""

    joined: tuple[str, ...] = ()
    left: tuple[str, ...] = ()


class ClusterView:
    def __init__(self, table: RequestTable, *, kv_transport: str = "auto",
                 wrap_instance: Callable[[object], InstanceHandle] = lambda h: h,
                 wrap_store: Callable[[object], StoreHandle] = lambda h: h):
        self.table = table
        self.kv_transport = kv_transport
        self._wrap_instance, self._wrap_store = wrap_instance, wrap_store
        # Instances whose member record or stats were written since the last snapshot.
        self._dirty: set[str] = set()
        self.members: dict[str, Member] = _TrackedDict(self._dirty)
        self.stats: dict[str, InstanceStats] = _TrackedDict(self._dirty)
        self.stores: dict[str, StoreInfo] = {}       # store address -> the node's store
        self.draining: set[str] = set()
        self.lost: set[str] = set()
        self.version = 0
        self.membership_changed = asyncio.Event()
        self._handles: dict[str, InstanceHandle] = {}
        self._store_handles: dict[str, StoreHandle] = {}
        # Incremental snapshot: an instance's snapshot is rebuilt only when what it is made of may
        # have changed (its member record or stats written, its draining/lost mark, the load the
        # request table places on it), and only its pool's tuple is rebuilt, so one poll costs
        # O(that instance + its pool), not a pass over every instance; an untouched pool keeps its
        # PoolSnapshot and with it the placement index built on it.
        self._inst_snaps: dict[str, tuple[tuple, InstanceSnapshot]] = {}
        self._pool_snaps: dict[str, PoolSnapshot] = {name: PoolSnapshot(name) for name in POOL_NAMES}
        self._pool_of: dict[str, str] = {}                       # iid -> pool its snapshot is in
        self._positions: dict[str, dict[str, int]] = {name: {} for name in POOL_NAMES}
        self._seen: tuple = ({}, {}, {}, frozenset(), frozenset())   # load, branches, queued, draining, lost
        self._snap = ClusterSnapshot(tuple(self._pool_snaps.values()))  # re-made only when a pool changed

    # ----------------------------------------------------------------- membership
    def apply_membership(self, m: Membership) -> MembershipChange | None:
        """Adopt the controller's membership (``None``: an older version, ignored)."""
        if m.version < self.version:
            return None
        self.version = m.version
        self.stores = {s.address: s for s in m.stores}
        seen, joined = set(), []
        for member in m.members:
            seen.add(member.instance_id)
            if member.instance_id not in self.members:
                # A (re)joining member starts clean: a "lost" or "draining" mark left by an earlier
                # holder of the same id must not hide this one's reports or keep it unplaced.
                self.lost.discard(member.instance_id)
                self.draining.discard(member.instance_id)
            self.members[member.instance_id] = member
            if member.state == DRAINING:
                self.draining.add(member.instance_id)
            if member.state in (SERVING, DRAINING):
                joined.append(member.instance_id)
        left = tuple(iid for iid in self.members if iid not in seen)
        for iid in left:
            self.members.pop(iid, None)
            self.stats.pop(iid, None)
            self._handles.pop(iid, None)
        self.membership_changed.set()
        return MembershipChange(tuple(joined), left)

    def record_stats(self, instance_id: str, stats: InstanceStats) -> None:
        if instance_id in self.members:
            self.stats[instance_id] = stats

    def mark_draining(self, instance_id: str) -> None:
        self.draining.add(instance_id)
        self.membership_changed.set()

    def mark_lost(self, instance_id: str) -> bool:
        """True the first time ``instance_id`` is declared lost."""
        if instance_id in self.lost:
            return False
        self.lost.add(instance_id)
        self.membership_changed.set()
        return True

    # ----------------------------------------------------------------- queries
    def serving(self, instance_id: str) -> bool:
        m = self.members.get(instance_id)
        return (m is not None and m.state == SERVING and instance_id not in self.draining
                and instance_id not in self.lost)

    def state(self, instance_id: str) -> str:
        """The member's state as the frontend sees it (draining as soon as it started to drain)."""
        m = self.members[instance_id]
        return DRAINING if instance_id in self.draining and m.state == SERVING else m.state

    def handle(self, instance_id: str) -> InstanceHandle:
        h = self._handles.get(instance_id)
        if h is None:
            h = self._handles[instance_id] = self._wrap_instance(self.members[instance_id].handle)
        return h

    def store(self, address: str) -> StoreHandle | None:
        info = self.stores.get(address)
        if info is None:
            return None
        h = self._store_handles.get(address)
        if h is None:
            h = self._store_handles[address] = self._wrap_store(info.handle)
        return h

    def prefix_namespace(self, node_id: str) -> str:
        """The store namespace its instances publish prompt prefixes under ("" before one is up)."""
        for m in self.members.values():
            if m.info is not None and m.info.node_id == node_id and m.info.prefix_namespace:
                return m.info.prefix_namespace
        return ""

    def snapshot(self, prefix: PrefixIndex | None = None) -> ClusterSnapshot:
        """What the router sees now; ``prefix``: the prefix index placement reads (none: empty).
        The same object while nothing changed."""
        reqs, branches, queued = self.table.load()
        s_reqs, s_branches, s_queued, s_draining, s_lost = self._seen
        dirty = self._dirty
        dirty |= _changed_keys(reqs, s_reqs)
        dirty |= _changed_keys(branches, s_branches)
        dirty |= _changed_keys(queued, s_queued)
        draining, lost = s_draining, s_lost
        if self.draining != s_draining or self.lost != s_lost:
            draining, lost = frozenset(self.draining), frozenset(self.lost)
            dirty |= draining ^ s_draining
            dirty |= lost ^ s_lost
        self._seen = (reqs, branches, queued, draining, lost)
        if dirty:
            if self._rebuild(dirty, reqs, branches, queued, draining, lost):
                self._snap = snap = ClusterSnapshot(tuple(self._pool_snaps.values()))
                # its pools by name, which ``ClusterSnapshot.pool`` would otherwise build on each
                # new snapshot (names are unique here); ``with_prefix`` carries it over
                snap.__dict__["_by_name"] = dict(self._pool_snaps)
            dirty.clear()
        return self._snap if prefix is None else self._snap.with_prefix(prefix)

    def _rebuild(self, dirty: set, reqs, branches, queued, draining, lost) -> bool:
        """Re-make the snapshots of ``dirty`` instances and the pools they are (or were) in;
        False when none of them changed."""
        cache, pool_of = self._inst_snaps, self._pool_of
        changed: dict[str, dict[str, InstanceSnapshot | None]] = {}     # pool -> iid -> snap (None: gone)
        for iid in dirty:
            m = self.members.get(iid)
            was = pool_of.get(iid)
            if m is None or m.pool not in self._positions:
                if was is not None:
                    changed.setdefault(was, {})[iid] = None
                    del pool_of[iid]
                cache.pop(iid, None)
                continue
            stats = self.stats.get(iid)
            serving = m.state == SERVING and iid not in draining and iid not in lost      # self.serving(iid)
            key = (m, None if stats is None else _snapshot_stats(stats), reqs.get(iid, 0), branches.get(iid, 0),
                   serving, queued.get(iid, 0))
            hit = cache.get(iid)
            if hit is not None and hit[0] == key and was == m.pool:     # the member compares by identity first
                continue
            snap = m.snapshot(stats, key[2], key[3], queued_prefill_tokens=key[5], serving=key[4])
            cache[iid] = (key, snap)
            if was is not None and was != m.pool:
                changed.setdefault(was, {})[iid] = None
            pool_of[iid] = m.pool
            changed.setdefault(m.pool, {})[iid] = snap
        for name, updates in changed.items():
            pos, pool = self._positions[name], self._pool_snaps[name]
            if all(v is not None and k in pos for k, v in updates.items()):
                # same instances: replaced in place, the placement index patched, not rebuilt
                self._pool_snaps[name] = pool.replacing({pos[iid]: snap for iid, snap in updates.items()})
                continue
            # the pool's membership changed: re-sort
            insts = [i for i in pool.instances if i.instance_id not in updates]
            insts += [v for v in updates.values() if v is not None]
            insts.sort(key=_instance_id)
            self._positions[name] = {i.instance_id: k for k, i in enumerate(insts)}
            self._pool_snaps[name] = PoolSnapshot(name, tuple(insts))
        return bool(changed)

    def pick(self, policy, pools: tuple[str, ...], exclude: frozenset[str] = frozenset(),
             branches: int = 1) -> Member | None:
        """The instance ``policy.pick_target`` chooses in the first pool (in order) that has one
        with free batch slots for ``branches``, else in the first that has one
        (``router.moves.first_target``)."""
        t = first_target(self.snapshot(), pools, exclude,
                         lambda insts, ex: policy.pick_target(insts, exclude=ex, branches=branches), branches)
        return None if t is None else self.members[t.instance_id]

    def transport_between(self, src_id: str, dst_id: str) -> tuple[str, str]:
        """(transport, receiver endpoint) for a page set from ``src_id`` to ``dst_id``: shared
        memory when both are on one node (``kv_transport: auto``), else TCP."""
        src, dst = self.members[src_id].info, self.members[dst_id].info
        transport = pair_transport(self.kv_transport, src.node_id if src else "", dst.node_id)
        if not dst.kv_endpoint(transport):        # the receiver has no such endpoint (forced tcp there)
            transport = TCP
        return transport, dst.kv_endpoint(transport)

    async def wait_for(self, pick: Callable[[], object], aborted: Callable[[], bool], limit_s: float):
        """``pick()`` once it returns something, re-asked on every membership change; ``None``
        when ``aborted()``; raises ``TimeoutError`` after ``limit_s``."""
        limit = time.monotonic() + limit_s
        while True:
            got = pick()
            if got is not None:
                return got
            if aborted():
                return None
            remaining = limit - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            self.membership_changed.clear()
            try:
                await asyncio.wait_for(self.membership_changed.wait(), min(remaining, 0.5))
            except asyncio.TimeoutError:
                pass
