"""Bringing branches back that no instance hosts, and parking KV that has nowhere to go.

    a branch is missing (its instance was lost, a move gave up, a part finished early)
      ensure_hosted ──▶ resume_locked(branches, pools):
         1. parked KV in a CPU store covers them ──▶ swap_in_part on the target (no recompute)
         2. else resume_part: the target recomputes prompt + tokens streamed so far, loading
            the longest prefix the node's CPU store holds first
    a drain has no peer for a part
      park ──▶ swap_out_part: its KV goes to the node's store, pinned (a ``ParkedPart`` on the
               request) ──▶ ensure_hosted once an instance can take it
    a request ends any other way ──▶ release_parked: unpin it in the store that holds it

State: the request's ``parked`` list (on ``RequestState``); everything else is read from the
``ClusterView`` or recorded in the ``RequestTable``. Callers of ``*_locked`` hold ``req.lock``.
"""
from __future__ import annotations

import logging
from typing import Callable

from thinkserve.router import LeastLoadedPolicy
from thinkserve.router.moves import resume_pools

from .cluster_view import ClusterView
from .counters import Counters
from .instance_handle import InstanceGone
from .messages import ErrorKind, Failure, Member, ParkedPart, Refusal
from .request_state import DECODE, Part, RequestState, RequestTable

log = logging.getLogger(__name__)


class Unavailable(RuntimeError):
    """Nothing can serve the request within its time (no serving instance of a usable pool)."""


class InvalidRequest(ValueError):
    """An engine refused the request's parameters: the client's error, not the cluster's."""


class Resumption:
    def __init__(self, view: ClusterView, table: RequestTable, counters: Counters, policy: LeastLoadedPolicy,
                 lost: Callable[[str], None], spawn: Callable, placement_wait_s: float = 60.0):
        self.view, self.table, self.counters, self.policy = view, table, counters, policy
        self.lost = lost
        self.spawn = spawn
        self.placement_wait_s = placement_wait_s

    def _pick(self, pools: tuple[str, ...], exclude: frozenset[str], branches: int = 1) -> Member | None:
        return self.view.pick(self.policy, pools, exclude, branches)

    async def ensure_hosted(self, req: RequestState) -> None:
        """Resume every unfinished branch that no live part hosts (after a loss or a failed move)."""
        try:
            async with req.lock:
                for part in list(req.parts.values()):
                    if part.instance_id in self.view.lost:
                        self.table.drop_part(req, part)
                        part.prefilled.set()
                if req.aborted or req.finished:
                    return
                hosted = {b for p in req.parts.values() for b in p.branches}
                missing = tuple(i for i in req.unfinished(range(req.params.n)) if i not in hosted and req.launched(i))
                if missing:
                    await self.resume_locked(req, missing, resume_pools(req.decode_pool))
        except Unavailable as e:
            req.fail(Failure(ErrorKind.UNAVAILABLE, str(e)))
        except InvalidRequest as e:
            req.fail(Failure(ErrorKind.INVALID, str(e)))

    async def resume_locked(self, req: RequestState, branches: tuple[int, ...], pools: tuple[str, ...],
                            *, launch: bool = False) -> None:
        """Host ``branches`` on a serving instance: from parked KV when some is parked for them,
        else by recompute from the prompt plus the tokens streamed so far (prompt KV from the CPU
        store when it holds it). ``launch``: they are a new wave of Best-of-N branches (no tokens
        yet), not a resume. Caller holds ``req.lock``."""
        exclude: set[str] = set()
        while branches and not req.aborted:
            try:
                target = await self.view.wait_for(lambda: self._pick(pools, frozenset(exclude), len(branches)),
                                                  lambda: req.aborted, self.placement_wait_s)
            except TimeoutError:
                raise Unavailable("no serving instance can take the request") from None
            if target is None:
                return
            if await self._swap_in_parked(req, branches, target):
                hosted = {i for p in req.parts.values() for i in p.branches}
                branches = tuple(b for b in branches if b not in hosted)
                continue
            part = self.table.new_part(req, target.instance_id, branches, DECODE)
            state = tuple((i, tuple(req.branches[i].token_ids)) for i in branches)
            try:
                adm = await self.view.handle(target.instance_id).resume_part(
                    part.part_id, req.prompt_token_ids, req.params, req.priority, state)
            except InstanceGone:
                self.table.drop_part(req, part)
                self.lost(target.instance_id)
                continue
            if not adm.ok:
                self.table.drop_part(req, part)
                exclude.add(target.instance_id)
                if adm.refusal is Refusal.INVALID:
                    raise InvalidRequest(adm.detail)
                continue
            if not launch:
                req.resumes += 1
                req.recomputed_tokens += adm.recomputed_tokens
                self.counters.resumed += 1
            if target.instance_id not in req.decode_instances:
                req.decode_instances.append(target.instance_id)
            return

    async def _swap_in_parked(self, req: RequestState, branches: tuple[int, ...], target: Member) -> bool:
        """Bring back a part parked in the CPU store whose branches are all wanted; True if one came."""
        for parked in list(req.parked):
            pb = parked.branch_indices
            if not set(pb) <= set(branches):
                continue
            req.parked.remove(parked)
            part = self.table.new_part(req, target.instance_id, pb, DECODE)
            try:
                adm = await self.view.handle(target.instance_id).swap_in_part(part.part_id, parked)
            except InstanceGone:
                adm = None
                self.lost(target.instance_id)
            if adm is not None and adm.ok:
                req.resumes += 1
                self.counters.resumed += 1
                if target.instance_id not in req.decode_instances:
                    req.decode_instances.append(target.instance_id)
                return True
            self.table.drop_part(req, part)   # fall back to recompute (the tokens are known)
            await self.release_parked(parked)
        return False

    async def release_parked(self, parked: ParkedPart) -> None:
        """Unpin a parked part's blocks in the store that holds them (its prompt's full blocks stay
        as unpinned prefix entries; the rest is deleted). Without this they stay pinned forever."""
        store = self.view.store(parked.store)
        if store is None:
            log.warning("parked KV in store %r cannot be released: no such store", parked.store)
            return
        try:
            await store.release(parked.swapped.namespace, list(parked.swapped.block_keys), list(parked.discard_keys))
            self.counters.parked_released += 1
        except InstanceGone as e:        # the store is gone, and its pins with it
            log.info("releasing parked KV in %s failed: %s", parked.store, e)

    async def park(self, req: RequestState, part: Part) -> None:
        """Nowhere to migrate to: swap the part's KV to the CPU store (or, failing that, drop it
        for recompute) and resume it once an instance can take it."""
        async with req.lock:
            if part.part_id not in req.parts:
                return
            self.table.drop_part(req, part)
            try:
                parked = await self.view.handle(part.instance_id).swap_out_part(part.part_id)
            except InstanceGone:
                parked = None
            if parked is not None:
                for index, tokens in parked.outputs():
                    req.branches[index].extend_to(list(tokens))
                req.changed.set()
                req.parked.append(parked)
        self.spawn(self.ensure_hosted(req))
