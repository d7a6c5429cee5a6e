"""The frontend's request orchestration: placement, prefill→decode handoff, migration, recovery.

    admit ──▶ place (router) ──▶ prefill part on a prefill instance ──prefilled──▶ handoff:
              the prefill instance sends one page set per decode instance (kvtransfer: shared
              memory when the pair shares a node, else TCP; ``kv_transport``), each decode
              instance imports its branches and decodes ──▶ deltas ──▶ client

KV parked in a node's CPU store (drain with no peer) is pinned there until it is swapped in; a
request that ends any other way (abort, cancel, deadline, recompute instead) releases it.

Every move of a request (handoff, migration on drain, resume after a loss, abort) holds the
request's lock, so moves never interleave; outside the lock, ``parts`` says exactly which
instance hosts which branch. A branch with no part is *missing* and ``ensure_hosted`` resumes
it elsewhere: from the KV the CPU store holds for its prompt, then by recomputing the rest.

No gRPC here and no Ray API beyond awaiting actor calls; ``frontend.py`` serves the RPCs.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass

from ray.exceptions import RayActorError, RayError

from thinkserve.router import COLOCATED as MODE_COLOCATED
from thinkserve.router import ClusterSnapshot, LeastLoadedPolicy, Placement, PlacementRequest, PoolSnapshot
from thinkserve.router.snapshot import LONG_DECODE, MIXED, POOL_NAMES, SERVING, SHORT_DECODE

from .messages import InstanceStats, Member, PartDelta, StoreInfo
from .request_state import COLOCATED, DECODE, PREFILL, Part, RequestState
from .transport_choice import AUTO, pair_transport

log = logging.getLogger(__name__)

_ACTOR_ERRORS = (RayActorError, RayError)


class Unavailable(RuntimeError):
    """Nothing can serve the request within its time (no serving instance of a usable pool)."""


@dataclass(frozen=True)
class SendTarget:
    kv_address: str
    part_id: str
    branch_indices: tuple[int, ...]
    transport: str = "tcp"          # "tcp" | "shm": which of the source's senders, to which endpoint


class Orchestrator:
    def __init__(self, policy: LeastLoadedPolicy, *, placement_wait_s: float = 60.0,
                 drain_timeout_s: float = 120.0, kv_transport: str = AUTO):
        self.policy = policy
        self.placement_wait_s = placement_wait_s
        self.drain_timeout_s = drain_timeout_s
        self.kv_transport = kv_transport
        self.stores: dict[str, StoreInfo] = {}     # store address -> the node's store actor
        self.members: dict[str, Member] = {}
        self.stats: dict[str, InstanceStats] = {}
        self.draining: set[str] = set()
        self.lost: set[str] = set()
        self.requests: dict[str, RequestState] = {}
        self.parts: dict[str, tuple[RequestState, Part]] = {}
        self.membership_changed = asyncio.Event()
        self._part_seq = itertools.count()
        self._tasks: set[asyncio.Task] = set()
        self.on_lost = None                     # callback(instance_id) -> tell the controller
        self.counters = dict(completed=0, failed=0, aborted=0, rejected=0, resumed=0, migrated=0,
                             kv_sends_tcp=0, kv_sends_shm=0, kv_bytes_tcp=0, kv_bytes_shm=0,
                             kv_seconds_tcp=0.0, kv_seconds_shm=0.0,
                             parked_released=0)

    # ----------------------------------------------------------------- bookkeeping
    def spawn(self, coro) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def new_part(self, req: RequestState, instance_id: str, branches, phase: str) -> Part:
        part = Part(f"{req.request_id}#{next(self._part_seq)}", instance_id, tuple(branches), phase)
        req.parts[part.part_id] = part
        self.parts[part.part_id] = (req, part)
        return part

    def drop_part(self, req: RequestState, part: Part) -> None:
        req.parts.pop(part.part_id, None)
        self.parts.pop(part.part_id, None)

    def serving(self, instance_id: str) -> bool:
        m = self.members.get(instance_id)
        return (m is not None and m.state == SERVING and instance_id not in self.draining
                and instance_id not in self.lost)

    def snapshot(self) -> ClusterSnapshot:
        reqs: dict[str, int] = {}
        branches: dict[str, int] = {}
        for req, part in self.parts.values():
            reqs[part.instance_id] = reqs.get(part.instance_id, 0) + 1
            branches[part.instance_id] = branches.get(part.instance_id, 0) + len(req.unfinished(part.branches))
        pools = []
        for name in POOL_NAMES:
            insts = []
            for m in self.members.values():
                if m.pool != name:
                    continue
                snap = m.snapshot(self.stats.get(m.instance_id), reqs.get(m.instance_id, 0),
                                  branches.get(m.instance_id, 0))
                if not self.serving(m.instance_id) and snap.state == SERVING:
                    snap = type(snap)(**{**snap.__dict__, "state": "draining"})
                insts.append(snap)
            pools.append(PoolSnapshot(name, tuple(sorted(insts, key=lambda i: i.instance_id))))
        return ClusterSnapshot(tuple(pools))

    def handle(self, instance_id: str):
        return self.members[instance_id].handle

    # ----------------------------------------------------------------- instance outputs
    def dispatch(self, delta: PartDelta) -> None:
        entry = self.parts.get(delta.part_id)
        if entry is None:
            return      # a part that moved or was aborted: its tokens are already known
        req, part = entry
        req.apply(delta.branches)
        if delta.prefilled:
            part.prefilled.set()
        if delta.finished:
            self.drop_part(req, part)
            part.prefilled.set()        # wakes a driver waiting on a prefill that finished outright
            if not req.finished and not req.aborted:
                self.spawn(self.ensure_hosted(req))

    def instance_lost(self, instance_id: str) -> None:
        """An instance died: every request with a branch there resumes elsewhere."""
        if instance_id in self.lost:
            return
        self.lost.add(instance_id)
        log.warning("instance %s lost; resuming its requests", instance_id)
        for req, part in list(self.parts.values()):
            if part.instance_id != instance_id:
                continue
            part.prefilled.set()
            if not req.lock.locked():       # a move in progress cleans up its own parts
                self.drop_part(req, part)
            self.spawn(self.ensure_hosted(req))
        self.membership_changed.set()
        if self.on_lost is not None:
            self.on_lost(instance_id)

    # ----------------------------------------------------------------- placement
    async def _wait(self, pick, req: RequestState, deadline: float | None):
        limit = time.monotonic() + self.placement_wait_s
        if deadline is not None:
            limit = min(limit, deadline)
        while True:
            got = pick()
            if got is not None:
                return got
            if req.aborted:
                return None
            remaining = limit - time.monotonic()
            if remaining <= 0:
                raise Unavailable("no serving instance can take the request")
            self.membership_changed.clear()
            try:
                await asyncio.wait_for(self.membership_changed.wait(), min(remaining, 0.5))
            except asyncio.TimeoutError:
                pass

    def _place(self, req: RequestState) -> Placement | None:
        preq = PlacementRequest(req.request_id, len(req.prompt_token_ids), req.params.n, req.params.max_tokens,
                                req.params.thinking_budget, req.priority)
        return self.policy.place(preq, self.snapshot())

    def _pick(self, pools: tuple[str, ...], exclude: frozenset[str] = frozenset()) -> Member | None:
        snap = self.snapshot()
        for pool in pools:
            t = self.policy.pick_target(snap.pool(pool).instances, exclude=exclude)
            if t is not None:
                return self.members[t.instance_id]
        return None

    @staticmethod
    def resume_pools(req: RequestState) -> tuple[str, ...]:
        if req.decode_pool == MIXED:
            return (MIXED, SHORT_DECODE, LONG_DECODE)
        other = SHORT_DECODE if req.decode_pool == LONG_DECODE else LONG_DECODE
        return tuple(p for p in (req.decode_pool or SHORT_DECODE, other, MIXED))

    # ----------------------------------------------------------------- driving a request
    async def drive(self, req: RequestState, deadline: float | None) -> None:
        """Start a request; afterwards deltas, moves and recovery carry it to the end."""
        try:
            while not req.aborted and not req.finished:
                placement = await self._wait(lambda: self._place(req), req, deadline)
                if placement is None:
                    return
                req.decode_pool = placement.decode_pool
                req.predicted_len = placement.predicted_len
                if placement.mode == MODE_COLOCATED:
                    if await self._start_part(req, placement.prefill_instance, range(req.params.n), COLOCATED):
                        return
                    continue
                prefill = await self._start_part(req, placement.prefill_instance, range(req.params.n), PREFILL)
                if prefill is None:
                    continue
                await prefill.prefilled.wait()
                await self.handoff(req, prefill, placement)
                return
        except Unavailable as e:
            req.error = str(e)
            req.changed.set()
        except ValueError as e:  # an engine refused the request's parameters
            req.error = str(e) if str(e).startswith("invalid") else f"invalid: {e}"
            req.changed.set()
        except Exception as e:  # never leave a client waiting on a driver that crashed
            log.exception("request %s failed", req.request_id)
            req.error = f"{type(e).__name__}: {e}"
            req.changed.set()

    async def _start_part(self, req: RequestState, instance_id: str, branches, phase: str) -> Part | None:
        async with req.lock:
            if req.aborted:
                return None
            part = self.new_part(req, instance_id, branches, phase)
            if req.t_prefill_start is None:
                req.t_prefill_start = time.monotonic()
            req.prefill_instance = instance_id
            if phase == COLOCATED:
                req.decode_instances = [instance_id]
            try:
                adm = await self.handle(instance_id).add_part.remote(
                    part.part_id, req.prompt_token_ids, req.params.to_dict(), req.priority)
            except _ACTOR_ERRORS:
                self.drop_part(req, part)
                self.instance_lost(instance_id)
                return None
            if not adm.ok:
                self.drop_part(req, part)
                if adm.reason.startswith("invalid"):
                    raise ValueError(adm.reason)
                self.draining.add(instance_id)     # refused = not admitting; the controller will say more
                return None
            return part

    # ----------------------------------------------------------------- moving KV
    async def handoff(self, req: RequestState, src: Part, placement: Placement) -> None:
        async with req.lock:
            if src.part_id not in req.parts:
                return                                  # lost or finished while prefilling
            req.t_prefilled = time.monotonic()
            plan = [(a.instance_id, req.unfinished(a.branch_indices)) for a in placement.decode]
            plan = [(iid, bs) for iid, bs in plan if bs]
            await self._move(req, src, plan, pools=self.resume_pools(req),
                             kind="fanout" if len(plan) > 1 else "handoff", publish_prefix=True)
            req.t_handoff_done = time.monotonic()

    async def migrate(self, req: RequestState, part: Part) -> bool:
        """Move a decoding part off its (draining) instance to a peer; True if it moved."""
        async with req.lock:
            if part.part_id not in req.parts or req.aborted:
                return False
            pools = self.resume_pools(req) if part.phase != COLOCATED else (MIXED,) + self.resume_pools(req)
            target = self._pick(pools, exclude=frozenset({part.instance_id}))
            branches = req.unfinished(part.branches)
            if target is None or not branches:
                return False
            await self._move(req, part, [(target.instance_id, branches)], pools=pools, kind="migrate")
            req.migrations += 1
            self.counters["migrated"] += 1
            return True

    async def _move(self, req: RequestState, src: Part, plan: list[tuple[str, tuple[int, ...]]],
                    pools: tuple[str, ...], kind: str, publish_prefix: bool = False) -> None:
        """Send ``src``'s KV to the planned instances (one page set each); branches whose send
        fails go to another instance, and past a few tries are resumed by recompute.
        Caller holds ``req.lock``. ``src`` is released (its blocks freed) at the end."""
        src_handle = self.handle(src.instance_id)
        tried: set[str] = {src.instance_id}
        pending = list(plan)
        missing: list[int] = []
        attempts = 0
        exported = False
        try:
            while pending:
                attempts += 1
                targets, new_parts = [], []
                for iid, branches in pending:
                    if not self.serving(iid):
                        m = self._pick(pools, exclude=frozenset(tried))
                        if m is None:
                            missing.extend(branches)
                            continue
                        iid = m.instance_id
                    part = self.new_part(req, iid, branches, DECODE)
                    new_parts.append(part)
                    targets.append(self._target(src.instance_id, iid, part.part_id, branches))
                pending = []
                if not targets:
                    break
                try:
                    outcome = await src_handle.send_part.remote(src.part_id, tuple(targets), kind, publish_prefix)
                    publish_prefix = False
                    exported = True
                except _ACTOR_ERRORS:
                    # The source died mid-send: keep the parts whose import committed.
                    self.instance_lost(src.instance_id)
                    for part in new_parts:
                        if not await self._has_part(part):
                            self.drop_part(req, part)
                            missing.extend(part.branches)
                    return
                for index, tokens in outcome.outputs:
                    req.branches[index].extend_to(list(tokens))
                req.changed.set()
                for part, result in zip(new_parts, outcome.results):
                    if result.ok:
                        self.counters[f"kv_sends_{result.transport}"] += 1
                        self.counters[f"kv_bytes_{result.transport}"] += result.bytes
                        self.counters[f"kv_seconds_{result.transport}"] += result.seconds
                        if part.instance_id not in req.decode_instances:
                            req.decode_instances.append(part.instance_id)
                        continue
                    self.drop_part(req, part)
                    tried.add(part.instance_id)
                    if result.peer_gone:      # or just slow: ask Ray before declaring it lost
                        self.spawn(self.check_alive(part.instance_id))
                    branches = req.unfinished(part.branches)
                    if not branches:
                        continue
                    if attempts >= 3:
                        missing.extend(branches)
                        continue
                    m = self._pick(pools, exclude=frozenset(tried))
                    if m is None:
                        missing.extend(branches)
                    else:
                        pending.append((m.instance_id, branches))
        finally:
            if src.part_id in req.parts:
                self.drop_part(req, src)
                try:
                    if exported:
                        await src_handle.release_part.remote(src.part_id)
                    else:
                        await src_handle.abort.remote(src.part_id)
                except _ACTOR_ERRORS:
                    pass
        if missing:
            await self._resume_locked(req, tuple(sorted(set(missing))), pools)

    def _target(self, src_id: str, dst_id: str, part_id: str, branches: tuple[int, ...]) -> SendTarget:
        """Shared memory when both instances are on one node (``kv_transport: auto``), else TCP."""
        src, dst = self.members[src_id].info, self.members[dst_id].info
        transport = pair_transport(self.kv_transport, src.node_id if src else "", dst.node_id)
        if not dst.kv_endpoint(transport):        # the receiver has no shm endpoint (forced tcp there)
            transport = "tcp"
        return SendTarget(dst.kv_endpoint(transport), part_id, branches, transport)

    async def check_alive(self, instance_id: str) -> None:
        m = self.members.get(instance_id)
        if m is None:
            return
        try:
            await asyncio.wait_for(m.handle.ping.remote(), 30)
        except _ACTOR_ERRORS:
            self.instance_lost(instance_id)
        except asyncio.TimeoutError:
            pass                        # the controller's health checks decide

    async def _has_part(self, part: Part) -> bool:
        try:
            return await self.handle(part.instance_id).has_part.remote(part.part_id)
        except _ACTOR_ERRORS:
            self.instance_lost(part.instance_id)
            return False

    # ----------------------------------------------------------------- recovery
    async def ensure_hosted(self, req: RequestState) -> None:
        """Resume every unfinished branch that no live part hosts (after a loss or a failed move)."""
        try:
            async with req.lock:
                for part in list(req.parts.values()):
                    if part.instance_id in self.lost:
                        self.drop_part(req, part)
                        part.prefilled.set()
                if req.aborted or req.finished:
                    return
                hosted = {b for p in req.parts.values() for b in p.branches}
                missing = tuple(i for i in req.unfinished(range(req.params.n)) if i not in hosted)
                if missing:
                    await self._resume_locked(req, missing, self.resume_pools(req))
        except Unavailable as e:
            req.error = str(e)
            req.changed.set()

    async def _resume_locked(self, req: RequestState, branches: tuple[int, ...], pools: tuple[str, ...]) -> None:
        """Recompute ``branches`` on a serving instance from the prompt plus the tokens streamed
        so far (prompt KV comes from the CPU store when it holds it). Caller holds ``req.lock``."""
        exclude: set[str] = set()
        while branches and not req.aborted:
            target = await self._wait(lambda: self._pick(pools, exclude=frozenset(exclude)), req, None)
            if target is None:
                return
            if await self._swap_in_parked(req, branches, target):
                branches = tuple(b for b in branches if b not in {i for p in req.parts.values() for i in p.branches})
                continue
            part = self.new_part(req, target.instance_id, branches, DECODE)
            state = tuple((i, tuple(req.branches[i].token_ids)) for i in branches)
            try:
                adm = await target.handle.resume_part.remote(part.part_id, req.prompt_token_ids, req.params.to_dict(),
                                                             req.priority, state)
            except _ACTOR_ERRORS:
                self.drop_part(req, part)
                self.instance_lost(target.instance_id)
                continue
            if not adm.ok:
                self.drop_part(req, part)
                exclude.add(target.instance_id)
                if adm.reason.startswith("invalid"):
                    raise ValueError(adm.reason)
                continue
            req.resumes += 1
            req.recomputed_tokens += adm.recomputed_tokens
            self.counters["resumed"] += 1
            if target.instance_id not in req.decode_instances:
                req.decode_instances.append(target.instance_id)
            return

    async def _swap_in_parked(self, req: RequestState, branches: tuple[int, ...], target: Member) -> bool:
        """Bring back a part parked in the CPU store whose branches are all wanted; True if one came."""
        for parked in list(req.parked):
            pb = tuple(b["index"] for b in parked["exported"]["branches"])
            if not set(pb) <= set(branches):
                continue
            req.parked.remove(parked)
            part = self.new_part(req, target.instance_id, pb, DECODE)
            try:
                adm = await target.handle.swap_in_part.remote(part.part_id, parked)
            except _ACTOR_ERRORS:
                adm = None
                self.instance_lost(target.instance_id)
            if adm is not None and adm.ok:
                req.resumes += 1
                self.counters["resumed"] += 1
                if target.instance_id not in req.decode_instances:
                    req.decode_instances.append(target.instance_id)
                return True
            self.drop_part(req, part)   # fall back to recompute (the tokens are known)
            await self.release_parked(parked)
        return False

    async def release_parked(self, parked: dict) -> None:
        """Unpin a parked part's blocks in the store that holds them (its prompt's full blocks stay
        as unpinned prefix entries; the rest is deleted). Without this they stay pinned forever."""
        store = self.stores.get(parked.get("store", ""))
        if store is None:
            log.warning("parked KV in store %r cannot be released: no such store", parked.get("store"))
            return
        try:
            await store.handle.release.remote(parked["namespace"], list(parked["block_keys"]),
                                              list(parked.get("discard_keys", ())))
            self.counters["parked_released"] += 1
        except _ACTOR_ERRORS as e:        # the store is gone, and its pins with it
            log.info("releasing parked KV in %s failed: %s", parked.get("store"), e)

    async def park(self, req: RequestState, part: Part) -> None:
        """Nowhere to migrate to: swap the part's KV to the CPU store (or, failing that, drop it
        for recompute) and resume it once an instance can take it."""
        async with req.lock:
            if part.part_id not in req.parts:
                return
            self.drop_part(req, part)
            try:
                swapped = await self.handle(part.instance_id).swap_out_part.remote(part.part_id)
            except _ACTOR_ERRORS:
                swapped = None
            if swapped is not None:
                for b in swapped["exported"]["branches"]:
                    req.branches[b["index"]].extend_to([int(t) for t in b["output_token_ids"]])
                req.changed.set()
                req.parked.append(swapped)
        self.spawn(self.ensure_hosted(req))

    # ----------------------------------------------------------------- abort and drain
    async def abort(self, req: RequestState, reason: str = "abort") -> None:
        """Abort everywhere: every part's blocks are freed on its instance."""
        req.aborted = True
        async with req.lock:
            for part in list(req.parts.values()):
                self.drop_part(req, part)
                part.prefilled.set()
                try:
                    await self.handle(part.instance_id).abort.remote(part.part_id)
                except _ACTOR_ERRORS:
                    pass
                except KeyError:
                    pass
            parked, req.parked = list(req.parked), []
            for p in parked:
                await self.release_parked(p)
            req.finish_all(reason)

    async def evacuate(self, instance_id: str) -> int:
        """Drain: stop placing on the instance, move its requests' KV to peers, return how many
        parts moved. Prefill parts finish their prefill and leave through the normal handoff."""
        self.draining.add(instance_id)
        self.membership_changed.set()
        moved = 0
        handle = self.members[instance_id].handle if instance_id in self.members else None
        if handle is None:
            return 0
        try:
            await handle.drain.remote()
        except _ACTOR_ERRORS:
            self.instance_lost(instance_id)
            return 0
        deadline = time.monotonic() + self.drain_timeout_s
        while True:
            here = [(req, part) for req, part in list(self.parts.values()) if part.instance_id == instance_id]
            if not here or instance_id in self.lost:
                return moved
            for req, part in here:
                if part.phase == PREFILL:
                    # Prefill parts leave through their handoff; one stuck past the deadline is
                    # taken off (store or recompute) like a decode part with nowhere to go.
                    if time.monotonic() > deadline:
                        await self.park(req, part)
                        moved += 1
                    continue
                if await self.migrate(req, part):
                    moved += 1
                elif time.monotonic() > deadline or self._pick(self.resume_pools(req),
                                                                 exclude=frozenset({instance_id})) is None:
                    # Nowhere to send the KV now: park it in the CPU store until capacity returns.
                    await self.park(req, part)
                    moved += 1
            await asyncio.sleep(0.02)
