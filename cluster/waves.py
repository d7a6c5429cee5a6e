"""Best-of-N waves (early consensus): later waves start from the prompt KV the instance that ran
the first wave already holds, not from a recompute of the prompt.

    prefill instance                                         decode instances
    ┌──────────────────────────────────────────────┐
    │ part #0   branches 0..w-1, prefilled (held) ──┼── handoff ──▶ wave 1 decodes
    │   └ fork ▶ reserve #1: branches w..n-1,       │
    │            the prompt's KV only (held)        │
    │ a branch finishes, the rule says go on:       │
    │   reserve ── fork ▶ part #2: branches k.. ────┼── send ─────▶ they compute one token (their
    │   (and the reserve lets them go)              │                last prompt token) and decode
    │ the rule stops: the reserve's branches are    │
    │   aborted there, their KV freed at once       │
    └──────────────────────────────────────────────┘

Colocated pools (one mixed instance prefills and decodes a request): the first wave is added
with its reserve (``add_part(reserve=...)``), which the engine forks off the running first wave
in the step its prompt is computed, so it exists however soon the first wave ends; a later wave
is forked off the reserve and started right there (``fork_part(start=True)``): each of its
branches computes one prompt token, as in the pools deployment, and nothing is sent.

The reserve costs the prompt's blocks (shared) for as long as branches may still launch. The
engine frees a reserve when it needs the blocks (``LLMEngine.fork_held(reserve=True)``: before
it would preempt a running request or leave a waiting one queued); the part then finishes with
reason ``reclaimed`` and ``reclaimed`` drops it. Without a reserve (reclaimed, a fork that
failed, its instance lost or draining) a later wave starts the older way,
``Resumption.resume_locked(launch=True)``: the prompt is recomputed except for what the prefix
cache or the node's CPU store holds.

State: the reserve is a ``Part`` of phase ``RESERVE`` in the ``RequestTable`` (so an abort, a
loss or a stop frees it like any part). Every method takes the request's lock.
"""
from __future__ import annotations

import logging
from typing import Callable

from thinkserve.router.snapshot import MIXED

from .cluster_view import ClusterView
from .counters import Counters
from .instance_handle import InstanceGone
from .part_moves import PartMoves
from .request_state import COLOCATED, PREFILL, RESERVE, Part, RequestState, RequestTable
from .resume import Resumption

log = logging.getLogger(__name__)


class Waves:
    def __init__(self, view: ClusterView, table: RequestTable, counters: Counters, moves: PartMoves,
                 resumption: Resumption, lost: Callable[[str], None]):
        self.view, self.table, self.counters = view, table, counters
        self.moves, self.resumption, self.lost = moves, resumption, lost

    @staticmethod
    def reserve_of(req: RequestState) -> Part | None:
        return next((p for p in req.parts.values() if p.phase == RESERVE), None)

    async def keep_reserve(self, req: RequestState, src: Part) -> None:
        """Before a prefilled first wave is handed off: keep the prompt's KV on its prefill
        instance for the branches not launched yet (a reserve part)."""
        async with req.lock:
            if req.aborted or src.part_id not in req.parts:
                return
            part = self.new_reserve(req, src.instance_id)
            if part is not None and not await self._fork(req, src, part, reserve=True):
                log.info("request %s: no reserve on %s; later waves recompute the prompt", req.request_id,
                         src.instance_id)

    def new_reserve(self, req: RequestState, instance_id: str) -> Part | None:
        """A reserve part on ``instance_id`` for the branches no part hosts yet, if the vote may
        still launch some and the request has none. Caller holds the request's lock."""
        c = req.consensus
        if c is None or c.done or self.reserve_of(req):
            return None
        hosted = {b for p in req.parts.values() for b in p.branches}
        todo = tuple(b for b in req.unfinished(range(req.params.n)) if b not in hosted)
        return self.table.new_part(req, instance_id, todo, RESERVE) if todo else None

    def reclaimed(self, req: RequestState, reserve: Part) -> None:
        """The engine freed the reserve for its blocks: later waves recompute the prompt. Its
        branches were never launched, so nothing of the request ends with it."""
        self.table.drop_part(req, reserve)
        self.counters.reserves_reclaimed += 1

    async def launch(self, req: RequestState, branches: tuple[int, ...], pools: tuple[str, ...]) -> None:
        """Start a wave: the branches the reserve holds go out like a handoff (their prompt KV
        sent, one decode instance for the wave); any other is resumed (prompt recomputed, less
        what the prefix cache or the CPU store holds)."""
        async with req.lock:
            if req.aborted or req.finished:
                return
            running = {b for p in req.parts.values() if p.phase != RESERVE for b in p.branches}
            todo = tuple(b for b in req.unfinished(branches) if b not in running)
            reserve = self.reserve_of(req)
            take = tuple(b for b in todo if reserve is not None and b in reserve.branches)
            if take and await self._launch_from_reserve(req, reserve, take, pools):
                todo = tuple(b for b in todo if b not in take)
            if todo:
                await self.resumption.resume_locked(req, todo, pools, launch=True)

    async def _launch_from_reserve(self, req: RequestState, reserve: Part, take: tuple[int, ...],
                                   pools: tuple[str, ...]) -> bool:
        member = self.view.members.get(reserve.instance_id)
        here = member is not None and member.pool == MIXED     # colocated: the wave runs where its KV is
        target = None if here else self.moves.pick(pools, branches=len(take))
        if (target is None and not here) or not self.view.serving(reserve.instance_id):
            return False
        part = self.table.new_part(req, reserve.instance_id, take, COLOCATED if here else PREFILL)
        if not await self._fork(req, reserve, part, start=here):
            await self.release(req, reserve)
            return False
        try:
            await self.view.handle(reserve.instance_id).abort_branches(reserve.part_id, take)
        except InstanceGone:
            self.lost(reserve.instance_id)
        reserve.branches = tuple(b for b in reserve.branches if b not in take)
        if not reserve.branches:        # naming all of them ended it there
            self.table.drop_part(req, reserve)
        if here:    # the fork started them: each may compute its prompt token before a cancel lands
            self.counters.wave_branches_forked += len(take)
        if not req.unfinished(take):    # the vote was decided while this launch held the lock: none goes
            await self.release(req, part)
            return True
        if not here:
            self.counters.wave_branches_forked += len(take)
            await self.moves.move(req, part, [(target.instance_id, take)], pools=pools, kind="fanout")
        return True

    async def _fork(self, req: RequestState, src: Part, part: Part, *, reserve: bool = False,
                    start: bool = False) -> bool:
        """``part``'s branches forked off ``src`` on its instance; dropped from the table if not."""
        try:
            if await self.view.handle(src.instance_id).fork_part(src.part_id, part.part_id, part.branches,
                                                                 reserve=reserve, start=start):
                return True
        except InstanceGone:
            self.lost(src.instance_id)
        self.table.drop_part(req, part)
        return False

    async def release(self, req: RequestState, reserve: Part) -> None:
        """Give a reserve's KV back (its instance drains, or it cannot fork any more), or a
        wave's forked off it that is not wanted any more. Caller holds the request's lock, or
        the part is its own."""
        self.table.drop_part(req, reserve)
        try:
            await self.view.handle(reserve.instance_id).abort(reserve.part_id)
        except (InstanceGone, KeyError):
            pass
