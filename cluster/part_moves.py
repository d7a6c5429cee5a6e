"""Moving a part's KV from its instance to others: the prefill→decode handoff (one page set per
decode instance for Best-of-N) and the migration of a decoding part (drain, rebalancing).

    PartMoves.handoff(req, prefill part, placement)  ─┐
    PartMoves.migrate(req, part, pools)               ─┴─▶ _move: the source exports once and
        sends each target its branches (``send_part`` → ``flows.send_share``); a failed target is
        retried on another instance (``router.moves.retry_target``), past that the branches are
        resumed by recompute (``Resumption``); the source is released at the end. A target
        without room now (its batch or KV cache full: the engine refuses imports it cannot run)
        is no failure: the branches go to another instance, and when every one is full the
        source keeps the KV and offers it again every ``ROOM_RETRY_S`` (up to ``room_wait_s``).

State: none of its own. It reads the ``ClusterView``, records parts in the ``RequestTable`` and
counts sends and migrations in ``Counters``. Every method is called with, or takes, the request's
lock, so moves of one request never interleave.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from thinkserve.router import LeastLoadedPolicy, Placement
from thinkserve.router.moves import retry_target

from .cluster_view import ClusterView
from .counters import Counters
from .instance_handle import InstanceGone
from .messages import Member, SendTarget
from .request_state import DECODE, Part, RequestState, RequestTable
from .resume import Resumption

log = logging.getLogger(__name__)

ROOM_RETRY_S = 0.1      # a page set every decode instance refused for room is offered again after this


class PartMoves:
    def __init__(self, view: ClusterView, table: RequestTable, counters: Counters, policy: LeastLoadedPolicy,
                 resumption: Resumption, lost: Callable[[str], None], spawn: Callable, room_wait_s: float = 60.0):
        self.view, self.table, self.counters, self.policy = view, table, counters, policy
        self.room_wait_s = room_wait_s
        self.resumption = resumption
        self.lost = lost
        self.spawn = spawn

    def pick(self, pools: tuple[str, ...], exclude: frozenset[str] = frozenset(), branches: int = 1) -> Member | None:
        """The least-loaded serving instance of the first pool (in order) that has one with free
        batch slots for ``branches`` (else of the first that has one: ``ClusterView.pick``)."""
        return self.view.pick(self.policy, pools, exclude, branches)

    async def handoff(self, req: RequestState, src: Part, placement: Placement, pools: tuple[str, ...]) -> None:
        async with req.lock:
            if src.part_id not in req.parts:
                return                                  # lost or finished while prefilling
            req.t_prefilled = time.monotonic()
            # only the branches the prefill part holds: under early consensus later waves start apart
            plan = [(a.instance_id, tuple(b for b in req.unfinished(a.branch_indices) if b in src.branches))
                    for a in placement.decode]
            plan = [(iid, bs) for iid, bs in plan if bs]
            # from here the decode parts count where they go (``move`` creates them before it
            # first waits), not the placement's plan
            self.table.unplan_decode(req)
            await self.move(req, src, plan, pools=pools,
                            kind="fanout" if len(plan) > 1 else "handoff", publish_prefix=True)
            req.t_handoff_done = time.monotonic()

    async def migrate(self, req: RequestState, part: Part, pools: tuple[str, ...],
                      target: str | None = None) -> bool:
        """Move a decoding part off its instance to a peer (``target``, else the least loaded of
        ``pools``); True if it moved."""
        async with req.lock:
            if part.part_id not in req.parts or req.aborted:
                return False
            if target is not None and not self.view.serving(target):
                return False
            branches = req.unfinished(part.branches)
            member = self.view.members[target] if target is not None else \
                self.pick(pools, exclude=frozenset({part.instance_id}), branches=max(1, len(branches)))
            if member is None or not branches:
                return False
            if not await self.move(req, part, [(member.instance_id, branches)], pools=pools, kind="migrate"):
                return False
            req.migrations += 1
            self.counters.migrated += 1
            return True

    async def move(self, req: RequestState, src: Part, plan: list[tuple[str, tuple[int, ...]]],
                   pools: tuple[str, ...], kind: str, publish_prefix: bool = False) -> bool:
        """Send ``src``'s KV to the planned instances (one page set each); branches whose send
        fails go to another instance, and past a few tries are resumed by recompute (branches
        refused for room wait for room instead, up to ``room_wait_s``).
        Caller holds ``req.lock``. ``src`` is released (its blocks freed) at the end. False: its
        instance could not export it (it finished there, unpolled yet): nothing moved, ``src``
        stays, and its poll brings the end."""
        src_handle = self.view.handle(src.instance_id)
        tried: set[str] = {src.instance_id}
        pending = list(plan)
        missing: list[int] = []
        full: list[tuple[int, ...]] = []    # branches every instance refused for room, offered again later
        attempts = 0
        room_deadline = time.monotonic() + self.room_wait_s
        exported = stayed = False
        try:
            while pending or full:
                if not pending:
                    if req.aborted or time.monotonic() > room_deadline:
                        missing.extend(b for bs in full for b in bs)
                        break
                    await asyncio.sleep(ROOM_RETRY_S)
                    tried = {src.instance_id}
                    for branches in map(req.unfinished, full):
                        m = self.pick(pools, exclude=frozenset(tried), branches=max(1, len(branches)))
                        if m is None:
                            missing.extend(branches)
                        elif branches:
                            pending.append((m.instance_id, branches))
                    full = []
                    continue
                attempts += 1
                targets, new_parts = [], []
                for iid, branches in pending:
                    if not self.view.serving(iid):
                        m = self.pick(pools, exclude=frozenset(tried), branches=len(branches))
                        if m is None:
                            missing.extend(branches)
                            continue
                        iid = m.instance_id
                    part = self.table.new_part(req, iid, branches, DECODE)
                    new_parts.append(part)
                    transport, address = self.view.transport_between(src.instance_id, iid)
                    targets.append(SendTarget(address, part.part_id, branches, transport))
                pending = []
                if not targets:
                    break
                try:
                    outcome = await src_handle.send_part(src.part_id, tuple(targets), kind, publish_prefix)
                    if not outcome.exported:
                        for part in new_parts:
                            self.table.drop_part(req, part)
                        stayed = True
                        return False
                    publish_prefix = False
                    exported = True
                except InstanceGone:
                    # The source died mid-send: keep the parts whose import committed.
                    self.lost(src.instance_id)
                    for part in new_parts:
                        if not await self._has_part(part):
                            self.table.drop_part(req, part)
                            missing.extend(part.branches)
                    return True
                for index, tokens in outcome.outputs:
                    req.branches[index].extend_to(list(tokens))
                req.changed.set()
                for part, result in zip(new_parts, outcome.results):
                    if result.ok:
                        self.counters.count_send(result.transport, result.bytes, result.seconds)
                        if part.instance_id not in req.decode_instances:
                            req.decode_instances.append(part.instance_id)
                        continue
                    log.info("%s of %s to %s failed: %s", kind, src.part_id, part.instance_id, result.error)
                    self.table.drop_part(req, part)
                    tried.add(part.instance_id)
                    if result.peer_gone:      # or just slow: ask before declaring it lost
                        self.spawn(self.check_alive(part.instance_id))
                    branches = req.unfinished(part.branches)
                    if not branches:
                        continue
                    m = self.pick(pools, exclude=frozenset(tried), branches=len(branches))
                    nxt = retry_target(attempts, None if m is None else self.view.snapshot().instance(m.instance_id),
                                       no_room=result.no_room)
                    if nxt is not None:
                        pending.append((nxt, branches))
                    elif result.no_room:
                        full.append(branches)
                    else:
                        missing.extend(branches)
        finally:
            if src.part_id in req.parts and not stayed:
                self.table.drop_part(req, src)
                try:
                    if exported:
                        await src_handle.release_part(src.part_id)
                    else:
                        await src_handle.abort(src.part_id)
                except InstanceGone:
                    pass
        if missing:
            await self.resumption.resume_locked(req, tuple(sorted(set(missing))), pools)
        return True

    async def check_alive(self, instance_id: str) -> None:
        if instance_id not in self.view.members:
            return
        try:
            await asyncio.wait_for(self.view.handle(instance_id).ping(), 30)
        except InstanceGone:
            self.lost(instance_id)
        except asyncio.TimeoutError:
            pass                        # the controller's health checks decide

    async def _has_part(self, part: Part) -> bool:
        try:
            return await self.view.handle(part.instance_id).has_part(part.part_id)
        except InstanceGone:
            self.lost(part.instance_id)
            return False
