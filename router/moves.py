"""Decisions about moving work that is already placed: where a part goes when it must leave its
instance, whether a failed send is retried, what a drain does with each part, which instances a
scale-down stops first, and when a pool rebalances. Pure functions over snapshots; the cluster
(``cluster/part_moves.py``, ``cluster/resume.py``, ``cluster/orchestrator.py``,
``cluster/controller.py``) carries them out.

    part must leave ──▶ resume_pools(decode pool) ──▶ first_target(snapshot, pools, exclude)
    send failed     ──▶ retry_target(attempts, candidate, no_room)  → instance | None (give up: recompute;
                        after refusals for room: wait for room, keeping the KV)
    drain, per part ──▶ drain_action(phase, peer?, past deadline?) → WAIT | MIGRATE | PARK
    scale down      ──▶ victim_order(candidates, k)
    pool imbalance  ──▶ rebalance_moves(pool snapshot, parts, margin) → (part, from, to) …
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Sequence

from .snapshot import LONG_DECODE, MIXED, SHORT_DECODE, ClusterSnapshot, InstanceSnapshot, PoolSnapshot

MAX_SEND_ATTEMPTS = 3


# ----------------------------------------------------------------------------- where moved work goes
def resume_pools(decode_pool: str) -> tuple[str, ...]:
    """Pools to try, in order, for a branch that leaves its instance (migration, resume after a
    loss, swap-in of parked KV): its own decode pool, the other decode pool, then mixed."""
    if decode_pool == MIXED:
        return (MIXED, SHORT_DECODE, LONG_DECODE)
    own = decode_pool or SHORT_DECODE
    other = SHORT_DECODE if own == LONG_DECODE else LONG_DECODE
    return (own, other, MIXED)


def migration_pools(decode_pool: str, colocated: bool) -> tuple[str, ...]:
    """A colocated part (prefilled and decoding on one mixed instance) tries mixed first."""
    pools = resume_pools(decode_pool)
    return (MIXED,) + pools if colocated else pools


Pick = Callable[[tuple[InstanceSnapshot, ...], frozenset[str]], "InstanceSnapshot | None"]


def first_target(snap: ClusterSnapshot, pools: Sequence[str], exclude: frozenset[str],
                 pick: Pick, branches: int = 1) -> InstanceSnapshot | None:
    """The first pool (in order) where ``pick`` finds an instance outside ``exclude`` with free
    batch slots for ``branches`` (``InstanceSnapshot.free_slots``); when no pool has one, the
    first where it finds any (the branches wait there for a slot, ``retry_target``'s room wait)."""
    for pool in pools:
        insts = snap.pool(pool).instances
        roomy = tuple(i for i in insts if i.free_slots >= branches)
        t = pick(roomy, exclude) if roomy else None
        if t is not None:
            return t
    for pool in pools:
        t = pick(snap.pool(pool).instances, exclude)
        if t is not None:
            return t
    return None


def retry_target(attempts: int, candidate: InstanceSnapshot | None,
                 max_attempts: int = MAX_SEND_ATTEMPTS, *, no_room: bool = False) -> str | None:
    """After a failed send (``attempts`` made so far): the instance to send the branches to next,
    or ``None``: none to try now. A refusal for lack of room (``no_room``: the receiver's batch or
    KV cache is full) is not a failure and counts toward no limit; when no instance is left to
    try, the sender keeps the KV and offers it again once one may have room. After ``max_attempts``
    failures the caller gives up on moving the KV and recomputes the branches instead."""
    if candidate is None or (attempts >= max_attempts and not no_room):
        return None
    return candidate.instance_id


# ----------------------------------------------------------------------------- draining
class DrainAction(enum.Enum):
    WAIT = "wait"          # leave it: a prefill part leaves through its own handoff
    MIGRATE = "migrate"    # send its KV to a peer
    PARK = "park"          # swap its KV to the CPU store (or drop it for recompute) until capacity returns


def drain_action(prefill: bool, *, peer_available: bool, past_deadline: bool) -> DrainAction:
    """What a drain does with one part still on the instance (asked again until none is left)."""
    if prefill:
        return DrainAction.PARK if past_deadline else DrainAction.WAIT
    if past_deadline or not peer_available:
        return DrainAction.PARK
    return DrainAction.MIGRATE


@dataclass(frozen=True)
class VictimCandidate:
    instance_id: str
    serving: bool          # False: still starting (nothing to move)
    num_parts: int         # parts it holds (-1: unknown, it did not answer)
    created_at: float


def victim_order(candidates: Sequence[VictimCandidate], k: int) -> tuple[str, ...]:
    """The ``k`` instances a scale-down stops: starting ones (or ones that did not answer) first,
    then the ones holding the fewest parts; ties go to the newest."""
    def key(c: VictimCandidate):
        load = c.num_parts if c.serving and c.num_parts >= 0 else -1
        return (load, -c.created_at, c.instance_id)
    return tuple(c.instance_id for c in sorted(candidates, key=key)[:max(0, k)])


# ----------------------------------------------------------------------------- rebalancing
@dataclass(frozen=True)
class MovablePart:
    """A decoding part the frontend could migrate now, and the KV blocks it holds (estimated
    from its tokens: its instance reports usage per instance, not per part)."""

    part_id: str
    instance_id: str
    blocks: int
    branches: int = 1      # its unfinished branches: the batch slots it takes on the target


@dataclass(frozen=True)
class Move:
    part_id: str
    source: str
    target: str


def rebalance_moves(pool: PoolSnapshot, parts: Sequence[MovablePart], margin: float,
                    max_moves: int = 1) -> tuple[Move, ...]:
    """Parts to migrate within ``pool`` so its serving instances' KV use evens out.

    While the busiest and the freest instance differ in KV use by more than ``margin`` (a fraction
    of a cache; a freshly joined, empty instance is the freest), move from the busiest to the
    freest the largest part that narrows the gap without reversing it (its blocks, as a share of
    each cache, sum to less than the gap) and whose branches fit the freest's free batch slots;
    ties go to the lower part id. An instance with a full batch is no target (the freest is the
    freest of those with a slot). At most ``max_moves``."""
    insts = [i for i in pool.serving() if i.num_total_blocks > 0]
    if len(insts) < 2:
        return ()
    used = {i.instance_id: i.num_total_blocks - i.num_free_blocks for i in insts}
    total = {i.instance_id: i.num_total_blocks for i in insts}
    slots = {i.instance_id: i.free_slots for i in insts}
    left = [p for p in parts if p.instance_id in used]
    moves: list[Move] = []
    while len(moves) < max_moves:
        usage = {iid: used[iid] / total[iid] for iid in used}
        busiest = max(usage, key=lambda i: (usage[i], i))
        open_ = [iid for iid in usage if slots[iid] > 0 and iid != busiest]
        if not open_:
            break
        freest = min(open_, key=lambda i: (usage[i], i))
        if usage[busiest] - usage[freest] <= margin:
            break
        # Blocks that would even the two out, counted in the busiest instance's blocks.
        gap = usage[busiest] - usage[freest]
        fits = [p for p in left if p.instance_id == busiest and 0 < p.blocks
                and p.blocks / total[busiest] + p.blocks / total[freest] < gap + 1e-9
                and used[freest] + p.blocks <= total[freest] and p.branches <= slots[freest]]
        if not fits:
            break
        part = min(fits, key=lambda p: (-p.blocks, p.part_id))
        moves.append(Move(part.part_id, busiest, freest))
        left.remove(part)
        used[busiest] -= part.blocks
        used[freest] += part.blocks
        slots[busiest] += part.branches
        slots[freest] -= part.branches
    return tuple(moves)
