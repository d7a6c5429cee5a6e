"""Decisions about moving work that is already placed: where a part goes when it must leave its
instance, whether a failed send is retried, what a drain does with each part, which instances a
scale-down stops first, and when a pool rebalances. Pure functions over snapshots; the cluster
(``cluster/part_moves.py``, ``cluster/resume.py``, ``cluster/orchestrator.py``,
``cluster/controller.py``) carries them out.

    part must leave ──▶ resume_pools(decode pool) ──▶ first_target(snapshot, pools, exclude)
    send failed     ──▶ retry_target(attempts, candidate)  → instance | None (give up: recompute)
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
                 pick: Pick) -> InstanceSnapshot | None:
    """The first pool (in order) where ``pick`` finds an instance outside ``exclude``."""
    for pool in pools:
        t = pick(snap.pool(pool).instances, exclude)
        if t is not None:
            return t
    return None


def retry_target(attempts: int, candidate: InstanceSnapshot | None,
                 max_attempts: int = MAX_SEND_ATTEMPTS) -> str | None:
    """After a failed send (``attempts`` made so far): the instance to send the branches to next,
    or ``None`` to give up on moving the KV and recompute them instead."""
    if attempts >= max_attempts or candidate is None:
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
