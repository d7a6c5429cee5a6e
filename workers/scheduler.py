"""Continuous batching: which tokens of which sequences the next step computes.

Pure Python. Each step spends a token budget (``max_num_batched_tokens``) in priority order::

    1. running requests, most urgent first: one token per decoding branch, a chunk of the
       prompt for a prefilling one (chunked prefill: a long prompt takes several steps).
       Out of blocks? Preempt the least urgent running request (lowest priority class, latest
       arrival): swap its blocks to the host block pool, else to the external swap space (when
       the engine has one: the plan names the request, its key and its blocks; the engine moves
       the KV and reports a refusal with ``swap_out_refused``), else drop them and recompute.
       Before any preemption, held reserves (early consensus: a Best-of-N request's prompt KV
       kept for its later waves) are freed, oldest first: losing one costs a later wave a
       prompt recompute, losing a running request's KV costs it its whole context.
    2. swapped and waiting requests, most urgent first, while blocks, batch slots and budget
       last. Strict order: a request that does not fit blocks everything behind it, so a big
       request is not starved by a stream of small ones.

Imports (a request whose KV another instance sends: hand-off, promotion, rebalancing) join the
running set without a pass through the queue, so they are admitted by the same rules first
(``reserve_import``): their branches must fit the free batch slots (``max_num_seqs`` holds), and
when a request of equal or higher priority is queued, the import must leave it the slots and
blocks it needs, else a stream of imports would overtake it for ever. A refused import takes no
block here (its sender keeps the KV and tries again later or elsewhere), so imports and queued
requests never hold blocks the other waits for.

Before that, a waiting request of a strictly more urgent class than a running one may preempt it.
The plan (``plan.StepPlan``) is plain data. Afterwards ``postprocess`` advances the bookkeeping,
appends the sampled tokens (the output processor decides stops) and frees finished branches; the
outcome of the engine's external swap moves comes back through ``on_external_moves``.
"""
from __future__ import annotations

import itertools
from bisect import insort_right
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Iterable

from .block_manager import BlockManager
from .config import EngineConfig
from .plan import ExternalMoves, SampledToken, ScheduledSeq, SeqSampling, StepPlan, SwapKey, SwapTransfer
from .sequence import Request, RequestStatus, Sequence


@dataclass
class ScheduledWork:
    request: Request
    seq: Sequence
    num_tokens: int
    samples: bool
    # A Best-of-N root sampling every branch's first token: the seq ids its other branches get
    # when ``on_computed`` forks it (they sample in the same step, ``ScheduledSeq.fanout``).
    fanout: tuple[int, ...] = ()


@dataclass
class ScheduleOutput:
    """One step: the plan for the model runner plus what the scheduler needs to finish the step."""

    plan: StepPlan = field(default_factory=lambda: StepPlan(()))
    work: list[ScheduledWork] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests that cannot fit the KV cache even alone: ``schedule`` finished them ("length").
    out_of_capacity: list[Request] = field(default_factory=list)
    # Reserves freed for their blocks: ``schedule`` finished them ("reclaimed").
    reclaimed: list[Request] = field(default_factory=list)


@dataclass
class StepProgress:
    """What ``postprocess`` did with a step's sampled tokens."""

    requests: list[Request] = field(default_factory=list)       # that got a token, in plan order
    new_tokens: dict[int, list[int]] = field(default_factory=dict)  # seq id -> the token it got
    prefilled: set[str] = field(default_factory=set)            # prefill role: now held for export


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, *, external_swap: bool = False,
                 instance_id: str = ""):
        self.config = config
        self.bm = block_manager
        # An external swap space backs up the host block pool; keys name this engine instance.
        self.external_swap = external_swap
        self.instance_id = instance_id
        # Keys of external swap space entries nobody will swap in any more (aborted or exported
        # while swapped out): the engine discards them (``take_dropped_swaps``).
        self._dropped_swaps: list[tuple[SwapKey, int]] = []
        self.block_size = block_manager.block_size
        self.requests: dict[str, Request] = {}  # every request the scheduler holds, any status
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._running_slots = 0          # sum of ``num_seqs_reserved`` over ``running``, kept as it changes
        self.swapped: list[Request] = []
        # Forked requests that hold their KV (shared prompt blocks) and wait for batch slots to
        # run (``add_starting``: a colocated Best-of-N request's later wave), most urgent first.
        self.starting: list[Request] = []
        self._seq_ids = itertools.count()
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0   # KV tokens dropped by preemption (swap refused or lost) to recompute
        self.num_recompute_preemptions = 0     # of those, KV dropped (the rest swapped out)
        self.num_computed_prompt_tokens = 0    # prompt positions the model computed (prefix hits and imports excluded)
        self.num_reclaimed_reserves = 0
        self._reserves: dict[str, Request] = {}    # held reserves, oldest first (freed for their blocks)
        # Batch slots of imports whose blocks are taken but whose KV is still arriving
        # (``reserve_import`` .. ``start_import`` / ``cancel_import``): counted as running.
        self._importing: dict[str, int] = {}

    def new_seq_id(self) -> int:
        return next(self._seq_ids)

    # ---- queues ---------------------------------------------------------------------------
    @staticmethod
    def _insert(queue: list[Request], req: Request) -> None:
        # After every request of an equal key, as appending and a stable sort would put it; a
        # binary search, since a queue is always sorted (a decode instance's runs to thousands).
        insort_right(queue, req, key=_sort_key)

    def _run(self, req: Request) -> None:
        self._insert(self.running, req)
        self._running_slots += req.num_seqs_reserved

    def _stop_running(self, req: Request) -> None:
        self.running.remove(req)
        self._running_slots -= req.num_seqs_reserved

    def add(self, req: Request) -> None:
        """Queue a request whose sequences hold no blocks (new, or an import to recompute)."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        req.status = RequestStatus.WAITING
        self._insert(self.waiting, req)

    def add_running(self, req: Request) -> None:
        """Adopt a request whose sequences already hold device blocks (a committed import)."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        req.status = RequestStatus.RUNNING
        self._run(req)

    def add_starting(self, req: Request) -> None:
        """Adopt a request whose sequences hold device blocks and that is to run here once its
        branches fit the free batch slots (a forked later wave, ``LLMEngine.fork_held(start=True)``):
        it runs at once when they do and no more urgent queued request needs them, else it is
        held (its KV kept, not scheduled) until ``schedule`` finds them (``_start_waiting``), so
        the batch never passes ``max_num_seqs``."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self._hold_until_slots(req)

    def _hold_until_slots(self, req: Request) -> None:
        """Hold ``req`` (its KV kept) in ``starting`` and start what fits the free slots now."""
        req.status = RequestStatus.HELD
        self._insert(self.starting, req)
        self._start_waiting()

    # ---- imports ----------------------------------------------------------------------------
    def reserve_import(self, request_id: str, num_seqs: int, num_blocks: int, priority: int) -> list[int] | None:
        """Blocks for an import of ``num_seqs`` branches whose KV (``num_blocks`` blocks) is sent
        here, its batch slots held until ``start_import`` or ``cancel_import``. None when it
        cannot run now: its branches do not fit the free batch slots, the blocks are not free, or
        it would take the slots or blocks of the most urgent queued request while that one is of
        equal or higher priority. Nothing changes then. An import without KV (no blocks) queues
        to recompute like a new request: always taken."""
        if request_id in self.requests or request_id in self._importing:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if num_blocks == 0:
            return []
        taken = self._slots_taken()
        if taken + num_seqs > self.config.max_num_seqs:
            return None
        head = self._queue_head()
        if head is not None and head.priority <= priority and (
                taken + num_seqs + head.num_seqs_reserved > self.config.max_num_seqs
                or self.bm.num_free_blocks - num_blocks < self._blocks_to_admit(head)):
            return None
        ids = self.bm.allocate_blocks(num_blocks)
        if ids is not None:
            self._importing[request_id] = num_seqs
        return ids

    def start_import(self, req: Request) -> None:
        """The import's KV is written: it runs (its branches hold the blocks ``reserve_import``
        took), or, without KV, queues to recompute."""
        self._importing.pop(req.request_id, None)
        if any(s.block_table for s in req.seqs):
            self.add_running(req)
        else:
            self.add(req)

    def cancel_import(self, request_id: str, block_ids) -> None:
        """The import failed: its slots and its blocks (``reserve_import``'s) are free again."""
        self._importing.pop(request_id, None)
        self.bm.free_blocks(block_ids)

    def add_held(self, req: Request) -> None:
        """Adopt a held request (prefill role: its branches share computed prompt KV and wait
        for export; ``LLMEngine.fork_held``)."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        req.status = RequestStatus.HELD
        if req.reserve:
            self._reserves[req.request_id] = req

    def detach(self, req: Request) -> None:
        """Take ``req`` out of every queue (it keeps its blocks and stays known by id)."""
        if req in self.running:
            self._stop_running(req)
        for queue in (self.waiting, self.swapped, self.starting):
            if req in queue:
                queue.remove(req)

    def reattach(self, req: Request, *, held: bool = False) -> None:
        """Put a detached (exported) request back where its KV says it belongs: held (prefill
        role, waiting for export again), running (its sequences hold device blocks; held in
        ``starting`` until its branches fit the free batch slots) or waiting (no KV: it
        recomputes)."""
        if self.requests.get(req.request_id) is not req:
            raise ValueError(f"request {req.request_id!r} is not known to the scheduler")
        if held:
            req.status = RequestStatus.HELD
        elif any(s.block_table for s in req.unfinished_seqs):
            # its slots went back when it was exported (others may hold them now): it runs again
            # once its branches fit, as a forked wave does (``add_starting``)
            self._hold_until_slots(req)
        else:
            req.status = RequestStatus.WAITING
            self._insert(self.waiting, req)

    def num_running_seqs(self) -> int:
        """Batch slots the running requests take (``Request.num_seqs_reserved`` summed): kept as
        requests join and leave ``running`` and as their branches finish or fork, since engine
        reports and every import's admission read it (a sum over the batch was a third of a
        large simulation)."""
        return self._running_slots

    def recount_running_seqs(self) -> int:
        """``num_running_seqs`` summed afresh (what integrity checks compare it with)."""
        return sum(map(_num_seqs_reserved, self.running))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.starting)

    # ---- finishing, holding, aborting ------------------------------------------------------
    def finish_seq(self, req: Request, seq: Sequence, reason: str) -> None:
        """A branch is done: its blocks go back (shared ones stay with their other owners)."""
        before = req.num_seqs_reserved
        seq.finish_reason = reason
        delta = req.num_seqs_reserved - before
        if delta and req in self.running:
            self._running_slots += delta
        self._free_seq(seq)
        if req.is_finished:
            self.detach(req)
            req.status = RequestStatus.FINISHED
            del self.requests[req.request_id]
            self._reserves.pop(req.request_id, None)

    def _free_seq(self, seq: Sequence) -> None:
        self.bm.free(seq)
        for h in seq.host_block_table:
            self.bm.host.decref(h)
        seq.host_block_table = []
        seq.swap_indices = []

    def drop_swapped_kv(self, req: Request) -> None:
        """Forget ``req``'s KV in the external swap space (queued for discarding) and host blocks."""
        if req.swap_key is not None:
            self._dropped_swaps.append((req.swap_key, req.num_swapped_blocks))
            req.swap_key, req.num_swapped_blocks = None, 0
        for seq in req.seqs:
            for h in seq.host_block_table:
                self.bm.host.decref(h)
            seq.host_block_table, seq.swap_indices = [], []

    def take_dropped_swaps(self) -> list[tuple[SwapKey, int]]:
        """(key, number of blocks) of external swap entries to discard; the list empties."""
        dropped, self._dropped_swaps = self._dropped_swaps, []
        return dropped

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.drop_swapped_kv(req)
        if req in self.running:
            self._stop_running(req)          # before its branches finish: it gives back what it took
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
            self._free_seq(seq)
        self.detach(req)
        req.status = RequestStatus.FINISHED
        del self.requests[request_id]
        self._reserves.pop(request_id, None)
        return req

    def hold(self, req: Request) -> None:
        """Prefill role: the request stops being scheduled but keeps its blocks."""
        self._stop_running(req)
        req.status = RequestStatus.HELD

    # ---- the step -------------------------------------------------------------------------
    def schedule(self) -> ScheduleOutput:
        out = ScheduleOutput()
        state = _StepState(budget=self.config.max_num_batched_tokens)
        self._preempt_for_urgent(out, state)
        if self.starting:
            self._start_waiting()
        for req in list(self.running):
            if req.status is RequestStatus.RUNNING and state.budget > 0:
                self._schedule_running(req, out, state)
        self._admit(out, state)
        out.plan = state.plan()
        for req in out.out_of_capacity:  # waiting would never make room: end it here
            for seq in req.unfinished_seqs:
                self.finish_seq(req, seq, "length")
        return out

    def queue_is_behind_running(self) -> bool:
        """Every queued request sorts after every running one: ``schedule()`` then preempts
        nothing for it, and whatever it admits comes last in the running order."""
        head = self._queue_head()
        return head is None or not self.running or head.sort_key > self.running[-1].sort_key

    def admit(self, num_steady: int) -> ScheduleOutput:
        """``schedule()`` for a step in which the running requests' ``num_steady`` branches (all
        their batch slots) each compute exactly one token into a block taken for it already,
        and ``queue_is_behind_running()``: the running part of ``schedule()`` would then schedule
        each branch its token, preempting nothing, so only the admission is left, done here by
        the same ``_admit`` with the budget and batch slots those branches leave. The plan and
        work list only the admitted requests (a caller that advances the steady branches itself:
        the simulator's lazy batch)."""
        out = ScheduleOutput()
        state = _StepState(budget=self.config.max_num_batched_tokens - num_steady)
        self._admit(out, state, num_steady)
        out.plan = state.plan()
        return out

    def _schedule_running(self, req: Request, out: ScheduleOutput, state: "_StepState") -> None:
        while True:
            chunks = self._chunks(req, state.budget)
            if not chunks:
                return
            seqs = [s for s, _ in chunks]
            if self.bm.can_append(seqs) or self._reclaim_until(lambda: self.bm.can_append(seqs), out):
                break
            victim = self.running[-1]  # least urgent; never one already scheduled this step
            if victim is req and self._alone_on_device(req):
                out.out_of_capacity.append(req)
                return
            self._preempt(victim, out, state)
            if victim is req:
                return
        for seq, n in chunks:
            self._schedule_seq(req, seq, n, out, state)

    def _chunks(self, req: Request, budget: int) -> list[tuple[Sequence, int]]:
        """(sequence, tokens to compute this step) for the unfinished branches within ``budget``."""
        # A branch is computed up to its last token, then samples; a Best-of-N root computes the
        # whole prompt and samples every branch's first token from its last position (fan-out).
        # (Runs for every running request of every step: written without helper calls.)
        chunks = []
        for seq in req.seqs:
            if seq.finish_reason is None:
                n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
                if n > 0:
                    chunks.append((seq, n))
                    budget -= n
        return chunks

    def _schedule_seq(self, req: Request, seq: Sequence, n: int, out: ScheduleOutput, state: "_StepState") -> None:
        copies = self.bm.append_slots(seq)
        if copies is None:  # callers check capacity first
            raise RuntimeError(f"append_slots failed for seq {seq.seq_id} after a capacity check")
        if copies:
            state.copies += copies
        start = seq.num_computed_tokens
        end = start + n
        tokens, table = seq.token_ids, seq.block_table
        samples = end == len(tokens)
        sampling = None
        fanout, fanout_ids = (), ()
        if samples:
            p = req.params
            sampling = SeqSampling(p.temperature, p.top_p, p.top_k, seq.seed, end - seq.num_prompt_tokens, p.logprobs)
            if not req.forked and p.n > 1:
                # The other branches' first tokens, from the same logits row, each with its own
                # seed: one step and one computation of the last prompt token for all n.
                fanout_ids = tuple(self.new_seq_id() for _ in range(1, p.n))
                fanout = tuple((sid, SeqSampling(p.temperature, p.top_p, p.top_k, req.branch_seed(i), 0, p.logprobs))
                               for i, sid in enumerate(fanout_ids, 1))
        # The table covers [0, end); it usually ends there (no block is allocated ahead): no slice.
        num_blocks = -(-end // self.block_size)
        state.seqs.append(ScheduledSeq(seq.seq_id, tuple(tokens[start:end]), start,
                                       tuple(table) if len(table) == num_blocks else tuple(table[:num_blocks]),
                                       sampling, fanout))
        state.budget -= n
        out.work.append(ScheduledWork(req, seq, n, samples, fanout_ids))

    def _alone_on_device(self, req: Request) -> bool:
        """True when nothing but ``req`` holds device blocks, so waiting cannot make room."""
        mine = {b for s in req.seqs for b in s.block_table}
        return self.bm.num_blocks - self.bm.num_free_blocks == len(mine)

    # ---- preemption -----------------------------------------------------------------------
    def _preempt(self, req: Request, out: ScheduleOutput, state: "_StepState") -> None:
        self._stop_running(req)
        seqs = req.unfinished_seqs
        self.num_preemptions += 1
        out.preempted.append(req)
        if self.config.preemption_mode == "swap":
            moved = self.bm.swap_out(seqs)
            if moved is not None:
                state.swap_out += moved
                req.status = RequestStatus.SWAPPED
                self._insert(self.swapped, req)
                return
            if self.external_swap and any(s.block_table for s in seqs):
                req.num_swap_outs += 1
                req.swap_key = SwapKey(self.instance_id, req.request_id, req.num_swap_outs)
                blocks = self.bm.release_for_swap(seqs)
                req.num_swapped_blocks = len(blocks)
                state.swap_outs.append(SwapTransfer(req.request_id, req.swap_key, tuple(blocks)))
                req.status = RequestStatus.SWAPPED
                self._insert(self.swapped, req)
                return
        self.num_recompute_preemptions += 1
        self._to_recompute(req)

    def _to_recompute(self, req: Request) -> None:
        """Drop the KV; each branch later prefills its prompt + outputs again."""
        for seq in req.unfinished_seqs:
            self.num_recomputed_tokens += seq.num_computed_tokens    # computed once, to be computed again
            self.bm.free(seq)
            seq.swap_indices = []
            seq.num_computed_tokens = 0
            seq.num_registered_blocks = 0
        req.swap_key, req.num_swapped_blocks = None, 0
        req.status = RequestStatus.WAITING
        self._insert(self.waiting, req)

    def swap_out_refused(self, request_id: str) -> None:
        """The external swap space could not take a planned swap-out (full, or unreachable): the
        request recomputes instead. Its device blocks were freed when the plan was made."""
        req = self.requests.get(request_id)
        if req is None or req.swap_key is None or req not in self.swapped:
            raise ValueError(f"request {request_id!r} has no pending external swap-out")
        self.swapped.remove(req)
        self.num_recompute_preemptions += 1   # the swap became a recompute
        self._to_recompute(req)

    def on_external_moves(self, moves: ExternalMoves) -> None:
        """The engine carried out the plan's external swap moves: recompute what failed."""
        for rid in moves.refused_swap_outs:
            self.swap_out_refused(rid)
        for rid in moves.lost_swap_ins:
            self.swap_in_failed(rid)

    def swap_in_failed(self, request_id: str) -> None:
        """A planned swap-in found no KV under its key (lost): free the blocks it was going to
        fill and recompute. Safe because such a request computes nothing in its swap-in step."""
        req = self.requests.get(request_id)
        if req is None or req not in self.running:
            raise ValueError(f"request {request_id!r} was not swapped in this step")
        self._stop_running(req)
        self._to_recompute(req)

    def _preempt_for_urgent(self, out: ScheduleOutput, state: "_StepState") -> None:
        """Make room for the most urgent queued request by preempting strictly less urgent ones."""
        head = self._queue_head()
        if head is None:
            return
        while self.running and self.running[-1].priority > head.priority and not self._fits(head):
            if self._has_slots(head) and self._reclaim_until(lambda: self._fits(head), out):
                return
            self._preempt(self.running[-1], out, state)

    def _start_waiting(self) -> None:
        """Run the held ``starting`` requests, most urgent first, while their branches fit the
        free batch slots and leave a more urgent queued request the slots it needs (strict
        order: the first that cannot start holds back the rest)."""
        cap = self.config.max_num_seqs
        taken = self._slots_taken()
        head = self._queue_head()
        while self.starting:
            req = self.starting[0]
            need = req.num_seqs_reserved
            if taken + need > cap or (head is not None and head.sort_key < req.sort_key
                                      and taken + need + head.num_seqs_reserved > cap):
                return
            del self.starting[0]
            req.status = RequestStatus.RUNNING
            self._run(req)
            taken += need

    def _slots_taken(self) -> int:
        """Batch slots in use: the running branches and those of imports whose KV is arriving."""
        return self.num_running_seqs() + (sum(self._importing.values()) if self._importing else 0)

    def _has_slots(self, req: Request) -> bool:
        taken = self._slots_taken()
        return taken + req.num_seqs_reserved <= self.config.max_num_seqs

    def _fits(self, req: Request) -> bool:
        return self._has_slots(req) and self._blocks_to_admit(req) <= self.bm.num_free_blocks

    def _blocks_to_admit(self, req: Request) -> int:
        """Free blocks a queued request needs to be admitted (prefix hits not counted)."""
        if req.status is RequestStatus.SWAPPED:
            return self._num_swapped_blocks(req)
        return sum(self.bm.num_blocks_for(s.num_tokens) for s in req.unfinished_seqs)

    def _reclaim_until(self, fits, out: ScheduleOutput) -> bool:
        """Free held reserves, oldest first, until ``fits()``; True once it does. A reserve
        whose blocks are all shared with running branches would free nothing: it stays."""
        for req in list(self._reserves.values()):
            if not self._frees_blocks(req):
                continue
            for seq in req.unfinished_seqs:
                self.finish_seq(req, seq, "reclaimed")
            out.reclaimed.append(req)
            self.num_reclaimed_reserves += 1
            if fits():
                return True
        return False

    def _frees_blocks(self, req: Request) -> bool:
        """Whether freeing ``req`` gives a block back: one only its own branches hold."""
        counts: dict[int, int] = {}
        for seq in req.unfinished_seqs:
            for b in seq.block_table:
                counts[b] = counts.get(b, 0) + 1
        return any(self.bm.ref_count[b] == k for b, k in counts.items())

    def _queue_head(self) -> Request | None:
        queued = self.waiting[:1] + self.swapped[:1]
        return min(queued, key=lambda r: r.sort_key) if queued else None

    # ---- admission ------------------------------------------------------------------------
    def _admit(self, out: ScheduleOutput, state: "_StepState", num_seqs: int | None = None) -> None:
        # num_seqs: batch slots taken (None: counted once here), kept up to date as requests are admitted
        while state.budget > 0:
            req = self._queue_head()
            if req is None:
                return
            if num_seqs is None:
                num_seqs = self._slots_taken()
            reserved = req.num_seqs_reserved
            if num_seqs + reserved > self.config.max_num_seqs:
                return
            if req.status is RequestStatus.SWAPPED:
                # Not in a step that preempted: the swap-in would fight over the blocks just freed.
                external = req.swap_key is not None
                if out.preempted or not (self._swap_in(req, state)
                                         or self._reclaim_until(lambda: self._swap_in(req, state), out)):
                    return
                num_seqs += reserved
                if external:
                    continue  # computes from the next step on, so a lost entry can still recompute
            elif not self._allocate(req) and not self._reclaim_until(lambda: self._allocate(req), out):
                return
            else:
                num_seqs += reserved
            chunks = self._chunks(req, state.budget)
            if not self.bm.can_append([s for s, _ in chunks]):
                return  # admitted, runs from the next step on
            for seq, n in chunks:
                self._schedule_seq(req, seq, n, out, state)

    def _num_swapped_blocks(self, req: Request) -> int:
        if req.swap_key is not None:
            return req.num_swapped_blocks
        return len(self.bm.unique_blocks(s.host_block_table for s in req.unfinished_seqs))

    def _swap_in(self, req: Request, state: "_StepState") -> bool:
        seqs = req.unfinished_seqs
        blocks = self._num_swapped_blocks(req)
        # Room for the blocks plus one new block per branch, so the request can decode at once;
        # unless that could never fit, then just the blocks (it may then finish out of capacity).
        need = blocks + len(seqs) if blocks + len(seqs) <= self.bm.num_blocks else blocks
        if need > self.bm.num_free_blocks:
            return False
        if req.swap_key is not None:
            fresh = self.bm.claim_for_swap_in(seqs, blocks)
            state.swap_ins.append(SwapTransfer(req.request_id, req.swap_key, tuple(fresh)))
            req.swap_key, req.num_swapped_blocks = None, 0
        else:
            state.swap_in += self.bm.swap_in(seqs)
        self.swapped.remove(req)
        req.status = RequestStatus.RUNNING
        self._run(req)
        return True

    def _allocate(self, req: Request) -> bool:
        done = []
        for seq in req.unfinished_seqs:
            if self.bm.allocate(seq) is None:
                for s in done:  # all branches or none
                    self.bm.free(s)
                    s.num_computed_tokens = 0
                    s.num_registered_blocks = 0
                return False
            done.append(seq)
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        self._run(req)
        return True

    # ---- after the forward pass -----------------------------------------------------------
    def postprocess(self, out: ScheduleOutput, sampled: Iterable[SampledToken], processor) -> StepProgress:
        """The runner computed ``out``'s plan and sampled ``sampled``: advance the bookkeeping,
        append each branch's token (``processor``, a ``postprocess.OutputProcessor``, applies the
        thinking budget and decides stops), free finished branches, and in the prefill role hold
        each request whose prompt is done and every branch has its first token."""
        self.on_computed(out)
        by_seq = {t.seq_id: t for t in sampled}
        progress = StepProgress()
        progressed: dict[str, Request] = {}
        for w in out.work:
            if not w.samples:
                continue
            token = by_seq.get(w.seq.seq_id)
            if token is None:
                raise RuntimeError(f"model runner returned no sample for seq {w.seq.seq_id}")
            reason = processor.append(w.request, w.seq, token)
            progress.new_tokens[w.seq.seq_id] = [w.seq.token_ids[-1]]
            progressed[w.request.request_id] = w.request
            if reason is not None:
                self.finish_seq(w.request, w.seq, reason)
        for req in progressed.values():
            if self.config.role == "prefill" and self.prefill_done(req):
                self.hold(req)
                progress.prefilled.add(req.request_id)
        progress.requests = list(progressed.values())
        return progress

    @staticmethod
    def prefill_done(req: Request) -> bool:
        """A prefill instance's request is done (held for its hand-off) once every branch has its
        first token; the simulator asks the same."""
        return (req.status is RequestStatus.RUNNING and not req.needs_fork
                and all(s.num_output_tokens >= 1 for s in req.unfinished_seqs))

    def on_computed(self, out: ScheduleOutput) -> None:
        """The runner computed the plan's tokens: advance counters, cache full blocks, fork each
        Best-of-N root that sampled its branches' first tokens (their work joins ``out.work``, so
        their samples are appended like the root's)."""
        bm = self.bm
        caching = bm.enable_prefix_caching
        for w in out.work:
            seq = w.seq
            done, prompt = seq.num_computed_tokens, seq.num_prompt_tokens
            if done < prompt:
                self.num_computed_prompt_tokens += min(done + w.num_tokens, prompt) - done
            seq.num_computed_tokens = done + w.num_tokens
            if caching:
                bm.register_computed_blocks(seq)
        for w in [w for w in out.work if w.fanout]:
            out.work.extend(ScheduledWork(w.request, child, w.num_tokens, True) for child in self._fork(w))

    def _fork(self, w: ScheduledWork) -> list[Sequence]:
        """Split a Best-of-N root that computed its whole prompt into its branches, which share
        every prompt block copy-on-write (the first to write into a shared one copies it)."""
        req, root = w.request, w.seq
        before = req.num_seqs_reserved
        children = []
        for i, seq_id in enumerate(w.fanout, 1):
            child = Sequence(seq_id, i, list(root.token_ids), root.num_prompt_tokens, req.branch_seed(i))
            child.in_thinking, child.num_thinking_tokens = root.in_thinking, root.num_thinking_tokens
            self.bm.fork(root, child)
            req.seqs.append(child)
            children.append(child)
        req.forked = True
        delta = req.num_seqs_reserved - before
        if delta and req in self.running:
            self._running_slots += delta
        return children

    # ---- views ----------------------------------------------------------------------------
    def block_tables(self):
        for req in self.requests.values():
            for seq in req.seqs:
                yield seq.block_table

    def host_block_tables(self):
        for req in self.requests.values():
            for seq in req.seqs:
                yield seq.host_block_table


_num_seqs_reserved = attrgetter("num_seqs_reserved")


def _sort_key(req: Request) -> tuple[int, int]:
    return req.sort_key


@dataclass
class _StepState:
    budget: int
    seqs: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swap_outs: list[SwapTransfer] = field(default_factory=list)
    swap_ins: list[SwapTransfer] = field(default_factory=list)

    def plan(self) -> StepPlan:
        return StepPlan(seqs=tuple(self.seqs), blocks_to_copy=tuple(self.copies),
                        blocks_to_swap_out=tuple(self.swap_out), blocks_to_swap_in=tuple(self.swap_in),
                        swap_outs=tuple(self.swap_outs), swap_ins=tuple(self.swap_ins))
