"""The frontend's request orchestration: placement, then every move of a request to its end.

    admit ──▶ place (router) ──▶ prefill part on a prefill instance ──prefilled──▶ handoff:
              the prefill instance sends one page set per decode instance (kvtransfer: shared
              memory when the pair shares a node, else TCP; ``kv_transport``), each decode
              instance imports its branches and decodes ──▶ deltas ──▶ client

The work is split by the state each part owns:

    ClusterView  (cluster_view.py)  members, stats, draining, lost, stores → router snapshots
    RequestTable (request_state.py) requests in flight and their parts (what is where)
    PartMoves    (part_moves.py)    handoff, migration: KV from one instance to others
    Resumption   (resume.py)        missing branches back (swap-in of parked KV, recompute); park
    Orchestrator (this file)        drive a new request; abort; drain; instance outputs and losses
    router/moves.py                 the pure decisions all of them take (pools, retries, drain)

Every move of a request (handoff, migration, resume after a loss, abort) holds the request's
lock, so moves never interleave; outside the lock, the table says exactly which instance hosts
which branch. A branch with no part is *missing* and ``ensure_hosted`` resumes it elsewhere.

No gRPC and no Ray here: instances are ``InstanceHandle`` objects (``instance_handle.py``), so the
orchestrator runs in process over ``InstanceCore`` objects in its unit test.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Callable

from thinkserve.router import COLOCATED as MODE_COLOCATED
from thinkserve.router import DISAGGREGATED as MODE_DISAGGREGATED
from thinkserve.router import LOCAL_PREFILL as MODE_LOCAL_PREFILL
from thinkserve.router import BranchProgress, Conductor, LeastLoadedPolicy, Placement, PlacementRequest
from thinkserve.router import Refusal as AdmissionRefusal
from thinkserve.router.consensus import ConsensusDecision
from thinkserve.router.moves import (DrainAction, MovablePart, drain_action, migration_pools, rebalance_moves,
                                     resume_pools)
from thinkserve.router.predictor import LengthFeatures, ProgressState, features_for
from thinkserve.router.snapshot import PREFILL_POOLS, SHORT_DECODE
from thinkserve.router.snapshot import PREFILL as PREFILL_POOL
from thinkserve.workers.block_hash import hash_blocks

from .cluster_view import ClusterView
from .counters import Counters
from .instance_handle import InstanceGone, InstanceHandle, StoreHandle
from .learner import Learner, one_step
from .messages import ErrorKind, Failure, InstanceStats, PartDelta, Refusal
from .part_moves import PartMoves
from .prefix_tracker import PrefixTracker
from .request_state import COLOCATED, DECODE, PREFILL, RESERVE, Part, RequestState, RequestTable
from .resume import InvalidRequest, Resumption, Unavailable
from .transport_choice import AUTO
from .waves import Waves

log = logging.getLogger(__name__)

__all__ = ["Orchestrator", "Unavailable", "InvalidRequest"]


class Orchestrator:
    def __init__(self, policy: LeastLoadedPolicy | Conductor, *, placement_wait_s: float = 60.0,
                 drain_timeout_s: float = 120.0, kv_transport: str = AUTO,
                 wrap_instance: Callable[[object], InstanceHandle] = lambda h: h,
                 wrap_store: Callable[[object], StoreHandle] = lambda h: h, prefix_affinity: bool = True,
                 decode_poll_interval_s: float = 0.0):
        self.policy = policy
        # the pools a prompt can prefill in: the instances whose prefix caches placement weighs
        # (the only ones asked to report them), and the only ones that make a client's first token
        self._prefix_pools = policy.prefix_pools if isinstance(policy, Conductor) else PREFILL_POOLS
        # Any other instance (a decode instance that only continues what it was handed) is polled
        # at most this often: its tokens reach the client coalesced (frontend.stream_interval_ms)
        # anyway, and a poll per engine step cost the frontend's loop a Ray call, a reply to
        # decode and a dispatch per step of every decode engine.
        self.decode_poll_interval_s = decode_poll_interval_s
        self.placement_wait_s = placement_wait_s
        self.drain_timeout_s = drain_timeout_s
        self.table = RequestTable()
        self.view = ClusterView(self.table, kv_transport=kv_transport, wrap_instance=wrap_instance,
                                wrap_store=wrap_store)
        self.counters = Counters()
        self._tasks: set[asyncio.Task] = set()
        # The predictor's training and refinement, run a step per loop turn and never while a
        # request is on its way to its first token (learner.py): inline, one finished Best-of-8
        # request held the frontend's loop for 10-80 ms.
        self.learner = Learner(self.spawn)
        self.on_lost: Callable[[str], None] | None = None   # tell the controller
        self.resumption = Resumption(self.view, self.table, self.counters, policy, self.instance_lost, self.spawn,
                                     placement_wait_s)
        self.moves = PartMoves(self.view, self.table, self.counters, policy, self.resumption,
                               self.instance_lost, self.spawn, room_wait_s=placement_wait_s)
        self.waves = Waves(self.view, self.table, self.counters, self.moves, self.resumption, self.instance_lost)
        self._promoting: set[str] = set()       # part ids with a promotion in flight
        # Local prefills (conditional disaggregation) until their first token: part id ->
        # (placed at, placement), for ``Conductor.observe_first_token``.
        self._local_pending: dict[str, tuple[float, Placement]] = {}
        # Where prompt prefixes are cached, as instances and stores report it (the Conductor's
        # prefix affinity); off: the index stays empty and nobody is asked.
        self.prefix_affinity = prefix_affinity and isinstance(policy, Conductor)
        self.prefixes = PrefixTracker()
        self.table.on_drop = self._part_dropped

    def _part_dropped(self, part_id: str) -> None:
        self.prefixes.settled(part_id)
        self._local_pending.pop(part_id, None)      # gone before its first token: not a measurement

    @property
    def requests(self) -> dict[str, RequestState]:
        return self.table.requests

    def spawn(self, coro) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def idle(self) -> None:
        """Until no background task (moves, resumes, aborts) is running."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # ----------------------------------------------------------------- instance outputs
    async def follow(self, instance_id: str, stopping: Callable[[], bool] = lambda: False) -> None:
        """Poll one instance for its outputs and stats until it is gone (or ``stopping()``);
        the frontend runs one per serving instance."""
        handle = self.view.handle(instance_id)
        member = self.view.members.get(instance_id)
        # Every engine keeps a prefix cache, but only the holders placement weighs report it: the
        # instances a prompt can prefill on (``Conductor.prefix_pools``). Any other decode
        # instance's cache (imported prompts, and an output block every block_size tokens of every
        # branch) is read by nothing, and its reports would cost poll traffic and index updates.
        reports = self.prefix_affinity and member is not None and member.pool in self._prefix_pools
        gap = self.decode_poll_interval_s if member is not None and member.pool not in self._prefix_pools else 0.0
        polled = 0.0
        # The first poll returns at once: a joining instance's blocks and slots are known to
        # placement and rebalancing from the moment it joins, not after an idle poll's wait.
        poll_wait = 0.0
        while not stopping():
            if gap:
                wait = polled + gap - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                polled = time.monotonic()
            try:
                res = await handle.poll(poll_wait, self.prefixes.instance_cursor(instance_id) if reports else None)
                poll_wait = 0.25
            except InstanceGone:
                self.instance_lost(instance_id)
                return
            except Exception:               # keep polling: a lost poller would strand its requests
                log.exception("polling %s failed", instance_id)
                await asyncio.sleep(0.5)
                continue
            if isinstance(self.policy, Conductor):
                self._note_decode_steps(self.view.stats.get(instance_id), res.stats)
            self.view.record_stats(instance_id, res.stats)
            if res.prefix is not None and instance_id in self.view.members and instance_id not in self.view.lost:
                self.prefixes.instance_reported(instance_id, res.prefix)
            for d in res.deltas:
                self.dispatch(d)

    async def follow_store(self, address: str, stopping: Callable[[], bool] = lambda: False,
                           interval_s: float = 0.25) -> None:
        """Poll one node's CPU store for the prompt-prefix blocks it gained and lost, until it
        leaves the membership (or ``stopping()``); the frontend runs one per store."""
        node = ""
        try:
            while not stopping() and self.prefix_affinity:
                info = self.view.stores.get(address)
                if info is None:
                    return
                node = info.node_id
                ns = self.view.prefix_namespace(node)
                store = self.view.store(address)
                if ns and store is not None:
                    try:
                        delta = await store.prefix_blocks(ns, self.prefixes.store_cursor(node))
                        if address in self.view.stores:
                            self.prefixes.store_reported(node, delta)
                    except Exception as e:      # gone or unreachable: nothing counts there until it answers
                        log.info("prefix report of the store %s failed: %s", address, e)
                        self.prefixes.forget_node(node)
                await asyncio.sleep(interval_s)
        finally:
            if node and address not in self.view.stores:
                self.prefixes.forget_node(node)

    def dispatch(self, delta: PartDelta) -> None:
        # Its instance's prefix report (applied before the deltas of its poll) now covers the prompt.
        self.prefixes.settled(delta.part_id)
        entry = self.table.parts.get(delta.part_id)
        if entry is None:
            return      # a part that moved or was aborted: its tokens are already known
        req, part = entry
        if self._local_pending and delta.branches and part.part_id in self._local_pending:
            placed_at, placement = self._local_pending.pop(part.part_id)
            if not req.aborted:         # a measured local prefill: refit its TTFT model
                self.policy.observe_first_token(placement, time.monotonic() - placed_at)
        if part.phase == RESERVE:       # it only ends, freed by its engine for the blocks
            if delta.finished:
                self.waves.reclaimed(req, part)
            return
        for decision in req.apply(delta.branches):
            self.counters.cancelled_branches += len(decision.cancelled)
            self.spawn(self.carry_out(req, decision))
        if req.holds_learner and (req.finished or any(d.token_ids for d in delta.branches)):
            self._first_token_out(req)
        if isinstance(self.policy, Conductor):
            self._note_hidden(req, part, delta)
            self._note_running(req, delta)
        if req.finished and not req.observed:
            self._observe(req)
        if delta.prefilled:
            part.prefilled.set()
        if delta.finished:
            self.table.drop_part(req, part)
            part.prefilled.set()        # wakes a driver waiting on a prefill that finished outright
            if not req.finished and not req.aborted:
                self.spawn(self.resumption.ensure_hosted(req))

    def instance_lost(self, instance_id: str) -> None:
        """An instance died: every request with a branch there resumes elsewhere."""
        self.prefixes.forget_instance(instance_id)
        if not self.view.mark_lost(instance_id):
            return
        log.warning("instance %s lost; resuming its requests", instance_id)
        for req, part in self.table.parts_on(instance_id):
            part.prefilled.set()
            if not req.lock.locked():       # a move in progress cleans up its own parts
                self.table.drop_part(req, part)
            self.spawn(self.resumption.ensure_hosted(req))
        if self.on_lost is not None:
            self.on_lost(instance_id)

    def instance_left(self, instance_id: str) -> None:
        """The controller removed it (drained, or declared dead): parts still there are lost."""
        self.prefixes.forget_instance(instance_id)
        if self.table.parts_on(instance_id):
            self.instance_lost(instance_id)

    # ----------------------------------------------------------------- driving a request
    def admit(self, req: RequestState, deadline: float | None) -> None:
        """Register a new request and start driving it (responses flow through ``req``)."""
        self.table.requests[req.request_id] = req
        req.holds_learner = True        # until its first token is out (``_first_token_out``)
        self.learner.hold()
        self.spawn(self.drive(req, deadline))

    def forget(self, request_id: str) -> None:
        req = self.table.requests.pop(request_id, None)
        if req is not None:
            self._first_token_out(req)

    def _first_token_out(self, req: RequestState) -> None:
        """The request's way to its first token is over (the token reached the frontend, or the
        request ended): learning may run again once the stream it woke has sent it."""
        if req.holds_learner:
            req.holds_learner = False
            asyncio.get_running_loop().call_soon(self.learner.release)

    def _place(self, req: RequestState) -> Placement | AdmissionRefusal | None:
        """Place (or place again) ``req``. A disaggregated placement's decode branches count on
        their instances from now until the hand-off creates their parts there
        (``RequestTable.plan_decode``), so the next decision, a poll later or not, sees those
        batch slots taken; placing again first takes back its own."""
        self.table.unplan_decode(req)
        placement = self._decide(req)
        if isinstance(placement, Placement) and placement.mode == MODE_DISAGGREGATED:
            self.table.plan_decode(req, placement.decode)
        return placement

    def _decide(self, req: RequestState) -> Placement | AdmissionRefusal | None:
        p = req.params
        if not isinstance(self.policy, Conductor):
            preq = PlacementRequest(req.request_id, len(req.prompt_token_ids), p.n, p.max_tokens,
                                    p.thinking_budget, req.priority)
            return self.policy.place(preq, self.view.snapshot())
        snap = self.view.snapshot(self.prefixes.index() if self.prefix_affinity else None)
        req.priority = self.policy.priority_of(req.slo_class)      # the class's engine priority (config)
        if req.features is None:        # once per request: the prediction does not change while it waits
            req.features = features_for(req.prompt_token_ids, self.policy.config.predictor, max_tokens=p.max_tokens,
                                        thinking_budget=p.thinking_budget)
        preq = PlacementRequest(req.request_id, len(req.prompt_token_ids), p.n, p.max_tokens, p.thinking_budget,
                                req.priority, slo_class=req.slo_class,
                                prompt_block_hashes=self._block_hashes(req, snap), features=req.features,
                                arrival=req.t_admitted, length=req.length)
        if req.length is None:
            req.length = self.policy.predict(preq)
        return self.policy.place(preq, snap, time.monotonic())

    @staticmethod
    def _block_hashes(req: RequestState, snap) -> tuple[int, ...]:
        if req.block_hashes is None:
            bs = next((i.block_size for i in snap.instances()), 16)
            req.block_hashes = tuple(hash_blocks(list(req.prompt_token_ids), bs))
        return req.block_hashes

    def _observe(self, req: RequestState) -> None:
        """Feed a finished request's branch lengths back to the Conductor's predictor (queued to
        the learner)."""
        req.observed = True
        if not isinstance(self.policy, Conductor) or req.features is None or req.aborted:
            return
        # Each branch's seconds from its first token to its finish (the Conductor holds a short
        # finish as long as it would have taken to pass long_threshold at that pace).
        now = time.monotonic()
        for b in req.branches:
            if b.finish_reason in ("stop", "length"):
                decode_s = max(0.0, (b.t_finished or now) - (b.t_first or req.t_admitted))
                self.learner.submit(self.policy.observing_finished(
                    req.features, len(b.token_ids), tuple(req.progress.get(b.index, ())),
                    at_least=req.learned_running.get(b.index, 0), now=now, decode_s=decode_s))

    def _note_decode_steps(self, before: InstanceStats | None, now: InstanceStats) -> None:
        """The decode-only steps an instance ran between two reports: one measurement of the
        Conductor's TPOT model for the instance's pool (its mean step time at its mean batch)."""
        member = self.view.members.get(now.instance_id)
        if member is None:                  # left the cluster: no pool to fit
            return
        b = before if before is not None else InstanceStats(now.instance_id)     # counters from zero
        steps = now.decode_steps - b.decode_steps
        if steps > 0:
            self.policy.observe_decode(member.pool, steps, now.decode_step_seconds - b.decode_step_seconds,
                                       now.decode_step_seqs - b.decode_step_seqs)

    def _note_running(self, req: RequestState, delta: PartDelta) -> None:
        """Branches of the delta still decoding past the long threshold: the predictor learns it
        now, once per branch (``Conductor.observe_running``: without it, it would learn only from
        finished lengths, which come shortest first)."""
        if req.features is None or req.aborted:
            return
        for d in delta.branches:
            b = req.branches[d.index]
            if d.index not in req.learned_running and not b.finished:
                # decided now (the finish's update depends on it), learned by the learner
                learned = self.policy.censored_at(len(b.token_ids))
                if learned:
                    req.learned_running[d.index] = learned
                    features, tokens, now = req.features, len(b.token_ids), time.monotonic()
                    self.learner.submit(one_step(lambda: self.policy.observe_running(features, tokens, now)))

    _MAX_PROGRESS = 16      # decode hidden states kept per branch (for refinement and training)

    def _note_hidden(self, req: RequestState, part: Part, delta: PartDelta) -> None:
        """Hidden states that came with the delta: the prefill's (kept for the handoff's
        prediction), and decode ones every k tokens (refine the branch's length now; train the
        decode probe when the request finishes). Only a short_decode branch is refined: promotions
        (``promote_once``) read nothing else's refinement."""
        m = self.view.members.get(part.instance_id)
        promotable = m is not None and m.pool == SHORT_DECODE
        for d in delta.branches:
            if d.hidden_state is None:
                continue
            if part.phase == PREFILL:
                if req.prefill_hidden is None:
                    req.prefill_hidden = d.hidden_state
                continue
            state = ProgressState(d.start + len(d.token_ids), d.hidden_state)
            kept = req.progress.setdefault(d.index, [])
            kept.append(state)
            del kept[:-self._MAX_PROGRESS]
            if req.length is not None and d.index not in req.refining and promotable:
                # by the learner, from the latest state when it gets there
                req.refining.add(d.index)
                self.learner.submit(one_step(lambda i=d.index: self._refine(req, i)))

    def _refine(self, req: RequestState, index: int) -> None:
        """The branch's length refined by its latest decode state (``req.refined``, promotions read it)."""
        req.refining.discard(index)
        kept = req.progress.get(index)
        if kept and req.length is not None:
            req.refined[index] = self.policy.refine(req.length, kept[-1])

    def _place_decode_after_prefill(self, req: RequestState, placement: Placement) -> Placement:
        """With the prefill's hidden state, predict again and re-place the decode branches."""
        if not isinstance(self.policy, Conductor) or req.prefill_hidden is None or req.features is None:
            return placement
        f = req.features
        req.features = LengthFeatures(f.prompt_len, f.ngrams, f.max_tokens, f.thinking_budget, req.prefill_hidden)
        p = req.params
        preq = PlacementRequest(req.request_id, len(req.prompt_token_ids), p.n, p.max_tokens, p.thinking_budget,
                                req.priority, slo_class=req.slo_class, features=req.features)
        req.length = self.policy.predict(preq)
        self.table.unplan_decode(req)           # its own planned branches are not load it competes with
        decided = self.policy.place_decode(preq, self.view.snapshot(), req.length)
        if decided is None:
            self.table.plan_decode(req, placement.decode)
            return placement
        pool, decode = decided
        self.table.plan_decode(req, decode)     # counted there until the hand-off creates the parts
        req.decode_pool = pool
        req.predicted_len = min(req.length.median(), p.max_tokens)
        return replace(placement, decode_pool=pool, decode=decode, length=req.length,
                       predicted_len=req.predicted_len)

    # ----------------------------------------------------------------- promotion
    async def run_promotions(self, interval_s: float, stopping: Callable[[], bool] = lambda: False) -> None:
        """Every ``interval_s``: promote (live-migrate) short_decode branches that outgrew their
        prediction to long_decode (the Conductor decides; ``PartMoves.migrate`` moves the KV)."""
        while not stopping():
            await asyncio.sleep(interval_s)
            try:
                self.promote_once()
            except Exception:           # keep checking: a crashed loop would silently stop promotions
                log.exception("promotion check failed")

    def promote_once(self) -> int:
        """Start the promotions the Conductor asks for now; returns how many were started."""
        if not isinstance(self.policy, Conductor):
            return 0
        progress, where = [], {}
        for req, part in list(self.table.parts.values()):
            m = self.view.members.get(part.instance_id)
            if (part.phase != DECODE or m is None or m.pool != SHORT_DECODE or req.length is None
                    or req.aborted or part.part_id in self._promoting):
                continue
            for b in req.unfinished(part.branches):
                progress.append(BranchProgress(req.request_id, b, SHORT_DECODE, part.instance_id,
                                               len(req.branches[b].token_ids), req.length, len(req.prompt_token_ids),
                                               req.refined.get(b)))
                where[(req.request_id, b)] = (req, part)
        if not progress:
            return 0
        started = 0
        for p in self.policy.promotions(self.view.snapshot(), tuple(progress)):
            req, part = where[(p.request_id, p.branch)]
            if part.part_id in self._promoting:
                continue                # one move per part: its other branches go with it
            self._promoting.add(part.part_id)
            self.spawn(self._promote(req, part, p.target))
            started += 1
        return started

    async def _promote(self, req: RequestState, part: Part, target: str) -> None:
        try:
            src_pool = self.view.members[part.instance_id].pool if part.instance_id in self.view.members else ""
            if await self.moves.migrate(req, part, migration_pools(req.decode_pool, False), target):
                if req.promotions == 0:
                    self.counters.promoted += 1
                req.promotions += 1
                dst_pool = self.view.members[target].pool if target in self.view.members else ""
                self.counters.promotions_out[src_pool] = self.counters.promotions_out.get(src_pool, 0) + 1
                self.counters.promotions_in[dst_pool] = self.counters.promotions_in.get(dst_pool, 0) + 1
                req.decode_pool = dst_pool or req.decode_pool
        finally:
            self._promoting.discard(part.part_id)

    async def drive(self, req: RequestState, deadline: float | None) -> None:
        """Start a request; afterwards deltas, moves and recovery carry it to the end."""
        try:
            while not req.aborted and not req.finished:
                limit = self.placement_wait_s if deadline is None else \
                    min(self.placement_wait_s, deadline - time.monotonic())
                try:
                    placement = await self.view.wait_for(lambda: self._place(req), lambda: req.aborted, limit)
                except TimeoutError:
                    raise Unavailable("no serving instance can take the request") from None
                if placement is None:
                    return
                if isinstance(placement, AdmissionRefusal):
                    self.counters.admission_refused += 1
                    req.fail(Failure(ErrorKind.EXHAUSTED, placement.reason))
                    return
                req.decode_pool = placement.decode_pool
                req.predicted_len = placement.predicted_len
                if placement.mode == MODE_COLOCATED:
                    if await self._start_part(req, placement.prefill_instance, req.first_wave, COLOCATED):
                        return
                    continue
                if placement.mode == MODE_LOCAL_PREFILL:
                    # Conditional disaggregation: the decode instance computes the prompt in place
                    # and decodes on, a decode part from the start (promotion and moves apply).
                    placed_at = time.monotonic()
                    if part := await self._start_part(req, placement.prefill_instance, req.first_wave, DECODE):
                        self._local_pending[part.part_id] = (placed_at, placement)
                        pool = placement.decode_pool
                        self.counters.local_prefills[pool] = self.counters.local_prefills.get(pool, 0) + 1
                        return
                    continue
                placed_at = time.monotonic()
                prefill = await self._start_part(req, placement.prefill_instance, req.first_wave, PREFILL)
                if prefill is None:
                    continue
                await prefill.prefilled.wait()
                if isinstance(self.policy, Conductor) and not req.aborted and req.error is None:
                    # A measured prefill: the Conductor refits its TTFT cost model from it.
                    self.policy.observe_first_token(placement, time.monotonic() - placed_at)
                placement = self._place_decode_after_prefill(req, placement)
                await self.waves.keep_reserve(req, prefill)     # later waves start from this prompt KV
                await self.moves.handoff(req, prefill, placement, resume_pools(req.decode_pool))
                if isinstance(self.policy, Conductor) and req.t_handoff_done is not None and req.t_prefilled:
                    # A measured hand-off: the Conductor weighs it against prefilling in place.
                    self.policy.observe_handoff(req.t_handoff_done - req.t_prefilled)
                return
        except Unavailable as e:
            req.fail(Failure(ErrorKind.UNAVAILABLE, str(e)))
        except InvalidRequest as e:  # an engine refused the request's parameters
            req.fail(Failure(ErrorKind.INVALID, str(e)))
        except Exception as e:  # never leave a client waiting on a driver that crashed
            log.exception("request %s failed", req.request_id)
            req.fail(Failure(ErrorKind.FAILED, f"{type(e).__name__}: {e}"))
        finally:
            self.table.unplan_decode(req)       # handed off (parts count now), or it never will be
            if req.error is not None or req.aborted or req.finished:
                self._first_token_out(req)      # it ended without one

    async def _start_part(self, req: RequestState, instance_id: str, branches, phase: str) -> Part | None:
        async with req.lock:
            if req.aborted:
                return None
            part = self.table.new_part(req, instance_id, branches, phase)
            if self.prefix_affinity and req.block_hashes:   # held there from now on, until it reports
                self.prefixes.in_flight(part.part_id, instance_id, req.block_hashes)
            if req.t_prefill_start is None:
                req.t_prefill_start = time.monotonic()
            req.prefill_instance = instance_id
            if phase in (COLOCATED, DECODE):        # DECODE: a local prefill (computed where it decodes)
                req.decode_instances = [instance_id]
            # the first wave is branches 0..w-1: an engine request of n = w samples exactly them
            params = req.params if len(part.branches) == req.params.n else req.params.replace(n=len(part.branches))
            # Colocated: the engine keeps the prompt's KV for the later waves once it is computed.
            reserve = self.waves.new_reserve(req, instance_id) if phase == COLOCATED else None
            extra = {} if reserve is None else {"reserve": (reserve.part_id, reserve.branches)}
            try:
                adm = await self.view.handle(instance_id).add_part(
                    part.part_id, req.prompt_token_ids, params, req.priority, **extra)
            except InstanceGone:
                self.table.drop_part(req, part)
                if reserve is not None:
                    self.table.drop_part(req, reserve)
                self.instance_lost(instance_id)
                return None
            if not adm.ok:
                self.table.drop_part(req, part)
                if reserve is not None:
                    self.table.drop_part(req, reserve)
                if adm.refusal is Refusal.INVALID:
                    raise InvalidRequest(adm.detail)
                self.view.mark_draining(instance_id)  # refused = not admitting; the controller will say more
                return None
            return part

    async def migrate(self, req: RequestState, part: Part, target: str | None = None) -> bool:
        """Move a decoding part to ``target`` (else the least loaded peer); True if it moved."""
        return await self.moves.migrate(req, part, migration_pools(req.decode_pool, part.phase == COLOCATED), target)

    # ----------------------------------------------------------------- early consensus
    async def carry_out(self, req: RequestState, decision: ConsensusDecision) -> None:
        """Do what the early-consensus controller decided: abort the cancelled branches where
        they run and the skipped ones the prefill instance holds for later waves (their KV is
        freed at once), start the next wave's branches."""
        if decision.cancel or decision.skip:
            await self.cancel_branches(req, decision.cancel + decision.skip)
        if decision.launch:
            await self.launch_branches(req, decision.launch)

    async def cancel_branches(self, req: RequestState, branches: tuple[int, ...]) -> None:
        async with req.lock:
            wanted = set(branches)
            for part in list(req.parts.values()):
                hit = tuple(b for b in part.branches if b in wanted)
                if not hit:
                    continue
                rest = req.unfinished(part.branches)    # the cancelled ones are marked finished already
                handle = self.view.handle(part.instance_id)
                try:
                    if rest:
                        await handle.abort_branches(part.part_id, hit)
                        part.branches = rest
                    else:
                        self.table.drop_part(req, part)
                        part.prefilled.set()
                        await handle.abort(part.part_id)
                except InstanceGone:
                    self.instance_lost(part.instance_id)
                except ValueError as e:     # held for a handoff: those branches end when the handoff skips them
                    log.info("request %s: branches %s not cancelled on %s: %s", req.request_id, hit,
                             part.instance_id, e)

    async def launch_branches(self, req: RequestState, branches: tuple[int, ...]) -> None:
        """Start a wave of branches on a serving instance: from the prompt KV the prefill
        instance holds for them (``Waves``), else from the prefix cache or the node's CPU store
        when they hold the prompt, else by recomputing it."""
        try:
            await self.waves.launch(req, branches, resume_pools(req.decode_pool))
        except Unavailable as e:
            req.fail(Failure(ErrorKind.UNAVAILABLE, str(e)))
        except InvalidRequest as e:
            req.fail(Failure(ErrorKind.INVALID, str(e)))

    # ----------------------------------------------------------------- rebalancing
    def _part_blocks(self, req: RequestState, part: Part, block_size: int) -> int:
        """KV blocks a part holds, from its tokens: the prompt's once, each branch's outputs."""
        prompt = len(req.prompt_token_ids)
        outs = [len(req.branches[b].token_ids) for b in part.branches]
        if not outs or block_size <= 0:
            return 0
        first = -(-(prompt + outs[0]) // block_size)
        return first + sum(-(-(prompt + o) // block_size) - prompt // block_size for o in outs[1:])

    async def rebalance(self, margin: float, max_moves: int = 1) -> int:
        """Migrate decoding parts from each pool's busiest instance to its freest while their KV
        use differs by more than ``margin`` (``router.moves.rebalance_moves``); returns the moves."""
        snap = self.view.snapshot()
        moved = 0
        for pool in snap.pools:
            if pool.name == PREFILL_POOL or len(pool.serving()) < 2:
                continue
            parts = []
            for req, part in list(self.table.parts.values()):
                m = self.view.members.get(part.instance_id)
                if m is None or m.pool != pool.name or part.phase in (PREFILL, RESERVE) or req.lock.locked() \
                        or req.aborted:
                    continue
                unfinished = req.unfinished(part.branches)
                if not unfinished:
                    continue
                bs = m.info.block_size if m.info else 0
                parts.append(MovablePart(part.part_id, part.instance_id, self._part_blocks(req, part, bs),
                                         len(unfinished)))
            for mv in rebalance_moves(pool, parts, margin, max_moves):
                entry = self.table.parts.get(mv.part_id)
                if entry is None:
                    continue
                req, part = entry
                if await self.moves.migrate(req, part, (pool.name,), target=mv.target):
                    self.counters.rebalanced[pool.name] = self.counters.rebalanced.get(pool.name, 0) + 1
                    moved += 1
        return moved

    async def rebalance_loop(self, interval_s: float, margin: float, stopping: Callable[[], bool] = lambda: False,
                             max_moves: int = 1) -> None:
        """``rebalance`` every ``interval_s`` (the frontend runs it when ``rebalance.enabled``)."""
        while not stopping():
            await asyncio.sleep(interval_s)
            try:
                await self.rebalance(margin, max_moves)
            except Exception:          # a failed round must not end the loop
                log.exception("rebalancing failed")

    # ----------------------------------------------------------------- abort and drain
    async def abort(self, req: RequestState, reason: str = "abort") -> None:
        """Abort everywhere: every part's blocks are freed on its instance."""
        req.aborted = True
        self._first_token_out(req)
        async with req.lock:
            for part in list(req.parts.values()):
                self.table.drop_part(req, part)
                part.prefilled.set()
                try:
                    await self.view.handle(part.instance_id).abort(part.part_id)
                except (InstanceGone, KeyError):
                    pass
            parked, req.parked = list(req.parked), []
            for p in parked:
                await self.resumption.release_parked(p)
            req.finish_all(reason)

    async def abort_all(self) -> None:
        for req in list(self.table.requests.values()):
            self.spawn(self.abort(req))

    async def evacuate(self, instance_id: str) -> int:
        """Drain: stop placing on the instance, move its requests' KV to peers, return how many
        parts moved. Prefill parts finish their prefill and leave through the normal handoff."""
        self.view.mark_draining(instance_id)
        if instance_id not in self.view.members:
            return 0
        try:
            await self.view.handle(instance_id).drain()
        except InstanceGone:
            self.instance_lost(instance_id)
            return 0
        moved = 0
        deadline = time.monotonic() + self.drain_timeout_s
        while True:
            here = self.table.parts_on(instance_id)
            if not here or instance_id in self.view.lost:
                return moved
            for req, part in here:
                if part.phase == RESERVE:   # held for later waves: they will start elsewhere
                    async with req.lock:
                        await self.waves.release(req, part)
                    continue
                peer = self.moves.pick(migration_pools(req.decode_pool, part.phase == COLOCATED),
                                       exclude=frozenset({instance_id}))
                action = drain_action(part.phase == PREFILL, peer_available=peer is not None,
                                      past_deadline=time.monotonic() > deadline)
                if action is DrainAction.MIGRATE:
                    moved += await self.migrate(req, part)
                elif action is DrainAction.PARK:
                    # Nowhere to send the KV now: park it in the CPU store until capacity returns.
                    await self.resumption.park(req, part)
                    moved += 1
            await asyncio.sleep(0.02)
