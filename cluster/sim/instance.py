"""One simulated engine instance: the real Scheduler and BlockManager against a modelled executor.

The scheduler and block manager are the engine's own (``thinkserve.workers``), and they stay the
single source of truth for admission, preemption and block accounting. What is modelled is the
model runner: a step's duration comes from the cost model, and its sampled tokens are
placeholders (a request's output length is given by the workload).

Speed: between events, an instance whose batch is all steady decoding (every running branch
computes one token, nothing queued can be admitted, nothing preempted) repeats the same step.
Such a *decode run* is planned by one real ``schedule()`` call, priced in closed form
(``cost.DecodeRun``) and applied in bulk at its end: each branch's tokens are appended at once,
``BlockManager.append_slots`` allocates the blocks they fill, ``register_computed_blocks`` hashes
them. A run ends at the first branch that finishes, before the KV cache would run out (the next
real step then preempts, exactly as the engine would), or early when an event arrives for this
instance (a new request, an import): the step in progress completes, the rest is not taken.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from itertools import repeat
from dataclasses import dataclass

from thinkserve.router.snapshot import InstanceSnapshot
from thinkserve.workers.block_manager import BlockManager
from thinkserve.workers.config import EngineConfig
from thinkserve.workers.migration import build_request, import_seqs
from thinkserve.workers.scheduler import ScheduledWork, ScheduleOutput, Scheduler
from thinkserve.workers.sequence import Request, RequestStatus

from .cost import BatchShape
from .steady_batch import SteadyBatch

MAX_RUN_STEPS = 1 << 20
_ALONE = (0, 0.0, 0.0)   # (other engines stepping, other processes' work, niced): a GPU's engine has it to itself


def _nth_after(factors: tuple[float, ...], k: int) -> float:
    """The price factor of the ``k``-th step (from 0) after an event whose following steps have
    their own factors (``LinearCost.post_prompt``, ``post_landing``): 1 past them."""
    return factors[k] if k < len(factors) else 1.0


@dataclass
class _InFlight:
    out: ScheduleOutput
    start: float
    end: float
    steps: int = 1              # > 1: a decode run of this many identical steps
    run: object = None          # cost.DecodeRun of a decode run
    # Every running branch computes one token and samples (a steady step or a decode run): its
    # completion is applied in bulk, and tells whether the next step is steady again.
    decode: bool = False
    lazy: bool = False          # the branches are the instance's ``SteadyBatch``, not ``out.work``
    decode_seqs: int = 0        # a decode-only step (no prompt token computed): its branches

    def steps_by(self, t: float) -> int:
        """Of a decode run, the steps completed by ``t`` (a step still running at ``t`` is not)."""
        done = self.run.steps_within(t - self.start, self.steps)
        return done - (self.start + self.run.time(done) > t)


class SimInstance:
    def __init__(self, instance_id: str, pool: str, role: str, cost, sink, *, node: int, index: int = 0, slot: int = 0,
                 num_blocks: int,
                 block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_prefix_caching: bool = True, bulk_decode: bool = True):
        self.instance_id, self.pool, self.role, self.node, self.index = instance_id, pool, role, node, index
        self.on_touch = lambda inst: None           # the simulator's: this instance's snapshot changed
        self.cost, self.sink = cost, sink
        # its decode steps' speed by its place on its node (the cpu kind's calibrated engines)
        self._speed = cost.engine_speed(slot) if hasattr(cost, "engine_speed") else 1.0
        self.config = EngineConfig(role=role, block_size=block_size, num_device_blocks=num_blocks,
                                   max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                   enable_prefix_caching=enable_prefix_caching, preemption_mode="recompute")
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.bm, instance_id=instance_id)
        self.bulk_decode = bulk_decode
        self.inbox: list[Request] = []
        self.pending_imports: deque = deque()       # (ExportedRequest, on_commit) waiting to start
        # The head of ``pending_imports`` waits for a batch slot: only a branch finishing (which
        # ends a decode run), a cancel, a move or a preemption (each a step boundary) frees one,
        # so decode runs go on meanwhile and later arrivals (behind it) interrupt nothing.
        self._imports_wait_for_slot = False
        self.migrations: dict[str, object] = {}     # request id -> target instance (promotions)
        self.cancels: set[str] = set()              # requests whose remaining branches are cancelled
        self.targets: dict[str, tuple[tuple[int, ...], int]] = {}  # request id -> (output lens, token)
        self.inflight: _InFlight | None = None
        self.version = 0                            # bumped when a scheduled wake-up is superseded
        self._arrivals = 0
        self.assigned_requests = 0
        self.assigned_branches = 0
        self._snapshot: InstanceSnapshot | None = None
        # Running requests that may have prompt left (as of _start): all (after a schedule()
        # pass), none (a steady step), or those a lazy batch's step admitted.
        self._prefilling: list | tuple = ()
        # Of the steady step being planned (``_steady_decode`` / ``_complete_decode``): the fewest
        # tokens a branch has left, and the positions the step's branches attend to.
        self._left, self._ctx = 0, 0
        self._num_running_seqs: int | None = None   # batch slots taken, when known from a steady step
        # A steady batch advanced lazily (``steady_batch.py``), None while the instance runs
        # eagerly. Only with the prefix cache off: lazy blocks are relabelled blocks, and which
        # block holds which hash would change what the cache evicts.
        self.batch: SteadyBatch | None = None
        self._lazy_ok = bulk_decode and not enable_prefix_caching and role != "prefill"
        self._joined: list[Request] = []            # imports committed while the batch was lazy
        self._admitted = None                       # (ScheduleOutput, requests) the lazy step admitted
        # Counters for the results.
        self.num_steps = 0
        self.num_runs = 0
        # Decode steps started since the last step with prompt tokens, and the price factors of the
        # first few after one (the cpu kind's ``LinearCost.post_prompt``; none for the others).
        self._since_prompt = 1 << 30
        self._post_prompt: tuple[float, ...] = getattr(cost, "post_prompt", ())
        # Steps started since a page set landed while a step was in flight, and the price factors
        # of the first few after one (the cpu kind's ``LinearCost.post_landing``).
        self._since_landing = 1 << 30
        self._post_landing: tuple[float, ...] = getattr(cost, "post_landing", ())
        # The uniform its last step with prompt tokens drew for its noise, where the simulator
        # draws a first token's latency against it (``Simulator._first_token_rho``); else None.
        self.prompt_draw: float | None = None
        self._landed_busy: set[str] = set()         # imports that reached the engine mid-step
        # Page sets that reached the engine during the step in flight: written into its cache
        # when that step ends, the next step waiting for the writes (the cpu kind's
        # ``LinearCost.hold_time``), and committed when it ends. (ExportedRequest, on_commit, bytes)
        self._holds = getattr(cost, "landing_hold", None) is not None
        self._arriving: list = []
        # An idle engine's loop waking up to a new request (the cpu kind's ``LinearCost.engine_wake``,
        # drawn by ``sink.wake_delay``): when the wake-up it scheduled is due, None when none is.
        self._waking = getattr(cost, "engine_wake", None) is not None
        self._wake_due: float | None = None
        # Steps since the engine last woke from idling, when its last step or run ended, and the
        # warm-up price factors by bucket of steps since a wake (the cpu kind's
        # ``LinearCost.warmup``; none for the others).
        self._warm_edges: tuple[int, ...] = getattr(cost, "warm_edges", ())
        self._warm_idle_s = getattr(cost, "warm_idle_s", 0.0)
        # [beside the node's other engines' steps][woken by a prompt step]
        self._warm_decode = ((getattr(cost, "warm_decode_wake", ()), getattr(cost, "warm_decode", ())),
                             (getattr(cost, "warm_decode_wake_co", ()), getattr(cost, "warm_decode_co", ())))
        self._warm_prompt = getattr(cost, "warm_prompt", ())
        self._since_wake, self._last_end, self._wake_prompt = 0, -math.inf, False
        # Decode-only steps completed: count, seconds, branches (``EngineHost.decode_step_totals``,
        # which the cluster's instances report for the Conductor's TPOT fit).
        self.decode_step_totals = (0, 0.0, 0)
        self.busy_time = 0.0
        self.kv_block_seconds = 0.0
        self._kv_t = 0.0

    def decode_totals(self, now: float) -> tuple[int, float, int]:
        """``decode_step_totals`` as of ``now``, with the steps of a decode run in flight that
        completed by then (the engine counts each step as it ends)."""
        n, seconds, seqs = self.decode_step_totals
        f = self.inflight
        if f is not None and f.steps > 1 and f.decode_seqs and now > f.start:
            done = f.steps_by(now)
            if done > 0:
                n, seconds, seqs = n + done, seconds + f.run.time(done), seqs + f.decode_seqs * done
        return n, seconds, seqs

    def step_end(self, now: float) -> float:
        """When the step in flight at ``now`` ends (of a decode run, the run's step that holds
        ``now``; a step starting at ``now`` holds it)."""
        f = self.inflight
        if f.steps > 1:
            return f.start + f.run.time(min(f.steps, max(0, f.steps_by(now)) + 1))
        return f.end

    # ---- what the router sees ---------------------------------------------------------------
    def snapshot(self) -> InstanceSnapshot:
        """Engine-reported fields (queue lengths, free blocks) as of this instance's last step
        boundary or decode-run start: like the cluster's engine reports, they may be a little
        old. The frontend-tracked fields (assigned requests and branches) are exact."""
        if self._snapshot is None:
            s = self.scheduler
            self._snapshot = InstanceSnapshot(
                self.instance_id, self.pool, num_waiting=len(s.waiting) + len(s.swapped) + len(self.inbox),
                num_running=len(s.running), num_free_blocks=self.bm.num_free_blocks,
                num_total_blocks=self.bm.num_blocks, assigned_requests=self.assigned_requests,
                assigned_branches=self.assigned_branches, queued_prefill_tokens=self._queued_prefill_tokens(),
                block_size=self.bm.block_size, node_id=f"node-{self.node}",
                num_running_seqs=(s.num_running_seqs() if self._num_running_seqs is None
                                  else self._num_running_seqs),
                max_num_seqs=self.config.max_num_seqs)
        return self._snapshot

    def _queued_prefill_tokens(self) -> int:
        s = self.scheduler
        queued = sum(r.num_prompt_tokens for r in self.inbox)
        for r in s.waiting:
            queued += r.num_prompt_tokens - r.seqs[0].num_computed_tokens
        for r in self._prefilling:
            root = r.seqs[0]
            if root.num_computed_tokens < r.num_prompt_tokens:
                queued += r.num_prompt_tokens - root.num_computed_tokens
        return queued

    def touch(self) -> None:
        if self._snapshot is not None:
            self._snapshot = None
            self.on_touch(self)

    # ---- work arriving ----------------------------------------------------------------------
    def submit(self, req: Request, output_lens: tuple[int, ...], token: int, now: float) -> float | None:
        """Queue a new request; returns a new wake-up time when one must be (re)scheduled."""
        self.targets[req.request_id] = (output_lens, token)
        self.inbox.append(req)
        if self._waking and self.inflight is None:     # an idle engine's loop wakes up to it
            self.touch()
            if self._wake_due is not None and self._wake_due >= now:
                return None                             # (already waking: the request is picked up then)
            self._wake_due = now + self.sink.wake_delay(self)
            return self._wake_due
        return self._interrupt(now)

    def submit_import(self, exported, output_lens: tuple[int, ...], token: int, on_commit, now: float,
                      nbytes: int = 0) -> float | None:
        """A page set (``nbytes`` of KV) reached this instance at ``now``: it starts at the next
        step boundary (a decode run ends at the step in flight). Where writes hold steps up
        (``LinearCost.hold_time``, the cpu kind), one that reaches a stepping engine is written
        when the step in flight ends and starts when the next ends (``_write_arrivals``); one
        that reaches an idle engine starts once written."""
        self.targets[exported.request_id] = (output_lens, token)
        if self.inflight is not None:
            self._landed_busy.add(exported.request_id)
            if self._holds:
                self._arriving.append((exported, on_commit, nbytes))
                return self._interrupt(now)
        self.pending_imports.append((exported, on_commit))
        if self._imports_wait_for_slot:
            self.touch()
            return None
        if self._holds:     # (an idle engine: written now, started once written)
            self.touch()
            return now + self.cost.hold_time(nbytes)
        return self._interrupt(now)

    def _write_arrivals(self, now: float, end: float | None) -> float | None:
        """The page sets that reached the engine during the step that just ended are written now:
        the step just started (cut to one step) waits for the writes, and they start when it
        ends; with no step to run, when the writes are done. Returns when to wake next."""
        hold = 0.0
        for exported, on_commit, nbytes in self._arriving:
            hold += self.cost.hold_time(nbytes)
            self.pending_imports.append((exported, on_commit))
        self._arriving.clear()
        self.touch()
        f = self.inflight
        if f is None:
            return now + hold if end is None else min(end, now + hold)
        if f.steps > 1:
            self._interrupt(now)
        f.end += hold
        return f.end

    def request_cancel(self, request_id: str, now: float) -> float | None:
        """Abort a request's branches here at the next step boundary (early consensus)."""
        self.cancels.add(request_id)
        return self._interrupt(now)

    def request_migration(self, request_id: str, target, now: float) -> float | None:
        """Move a request (its unfinished branches here) to ``target`` at the next step boundary."""
        self.migrations.setdefault(request_id, target)
        return self._interrupt(now)

    def _interrupt(self, now: float) -> float | None:
        self.touch()
        f = self.inflight
        if f is None:
            return now
        if f.steps > 1 and f.end > now:
            steps = f.run.steps_within(now - f.start, f.steps)
            if steps < f.steps:
                f.steps, f.end = steps, f.start + f.run.time(steps)
                return f.end
        return None

    # ---- the engine loop --------------------------------------------------------------------
    def wake(self, now: float) -> float | None:
        """Finish the step (or run) in flight, take new work, start the next. Returns when to
        wake next, or None when idle."""
        self._account_kv(now)
        self._wake_due = None
        steady = None
        if self.inflight is not None:
            f, self.inflight = self.inflight, None
            self.busy_time += f.end - f.start
            self._since_wake += f.steps
            self._last_end = f.end
            steady = self._complete(f, now)
        if self.cancels or self.migrations or self.inbox or self.pending_imports:
            steady = None
        for request_id in sorted(self.cancels):
            req = self.scheduler.requests.get(request_id)
            if req is not None and req.status is not RequestStatus.EXPORTED:
                if self.batch is not None:
                    self.batch.settle_request(req)
                unfinished = req.unfinished_seqs
                self.scheduler.abort(request_id)
                for seq in unfinished:
                    self.sink.on_seq_cancelled(self, req, seq, now)
        self.cancels.clear()
        for request_id, target in self.migrations.items():
            req = self.scheduler.requests.get(request_id)
            if req is not None and req.status in (RequestStatus.RUNNING, RequestStatus.WAITING):
                if self.batch is not None:
                    self.batch.settle_request(req)
                self.scheduler.detach(req)
                req.status = RequestStatus.EXPORTED
                self.sink.on_migrating(self, req, target, now)
        self.migrations.clear()
        for req in self.inbox:
            req.arrival = self._next_arrival()
            self.scheduler.add(req)
        self.inbox.clear()
        self._commit_imports(now)
        self.touch()
        end = self._start(now, steady)
        return self._write_arrivals(now, end) if self._arriving else end

    def _next_arrival(self) -> int:
        self._arrivals += 1
        return self._arrivals

    def _imports_may_start(self) -> bool:
        """Page sets wait to start here, and may before this instance's next step boundary."""
        return bool(self.pending_imports) and not self._imports_wait_for_slot

    def _commit_imports(self, now: float) -> None:
        """Start the page sets that arrived, in order, as the engine's ``import_request`` +
        ``commit_import`` would: the head waits here (its sender keeps the KV) while it cannot
        run (``Scheduler.reserve_import``)."""
        s = self.scheduler
        self._imports_wait_for_slot = False
        while self.pending_imports:
            exported, on_commit = self.pending_imports[0]
            seqs = import_seqs(exported)
            ids = s.reserve_import(exported.request_id, seqs, len(exported.block_ids), exported.priority)
            if ids is None:
                self._imports_wait_for_slot = s.num_running_seqs() + seqs > self.config.max_num_seqs
                return
            self.pending_imports.popleft()
            if exported.request_id in self._landed_busy:    # the steps it starts in are priced apart
                self._landed_busy.discard(exported.request_id)
                if self._post_landing:
                    self._since_landing = 0
            req = build_request(exported, ids, self.bm, s.new_seq_id, self._next_arrival())
            s.start_import(req)
            if self.batch is not None:
                self._joined.append(req)
            on_commit(self, req, now)

    def _start(self, now: float, steady_work: list | None = None) -> float | None:
        """``steady_work``: the branches of the decode step (or run) just completed that go on,
        when they are all the running branches and nothing else changed (``_complete_decode``)."""
        joined, self._joined = self._joined, []
        if self.batch is not None:
            if self._lazy_next(joined):
                return self._start_lazy(now)
            steady_work = None  # the batch is settled: the eager path decides
        out, s = None, self.scheduler
        if self.bulk_decode:
            out = self._steady_next(steady_work) if steady_work is not None else self._steady_decode()
        steady = out is not None
        if steady and self._lazy_ok and self._enter_lazy(out.work):
            return self._start_lazy(now)
        self._prefilling = () if steady else s.running
        self._num_running_seqs = len(out.work) if steady else None
        if out is None:
            out = self.scheduler.schedule()
            for req in out.out_of_capacity:
                for seq in req.unfinished_seqs:
                    self.scheduler.finish_seq(req, seq, "length")
                    self.sink.on_seq_finished(self, req, seq, now, truncated=True)
            if out.plan.is_empty:
                return None if not out.out_of_capacity else now
            if self._lazy_ok and self._steady_plan(out) and self._enter_lazy(out.work):
                return self._start_lazy(now)  # e.g. a full batch with a queue: nothing admitted
        steps = self._run_length(out, steady) if self.bulk_decode else 1
        # Engines of a node share its cores (cpu kind): priced by how many others step now and
        # by other processes' work (a recorded run's).
        load = self.sink.node_load(self.node) if self.cost.shares_cores else _ALONE
        # (the cpu kind's warm-up prices a step by whether it has prompt tokens: its shape, once)
        shape = self._shape(out) if self._warm_edges and not steady else None
        warm, steps = self._warmup(now, shape is not None and shape.prefill_tokens > 0, steps, load[0] > 0)
        if steps > 1 and self._runs_priced():
            ctx0 = self._ctx if steady else sum(w.seq.num_computed_tokens + 1 for w in out.work)
            run, steps = self._run(self.cost.decode_run(len(out.work), ctx0, *load), warm, steps, now)
            self.inflight = _InFlight(out, now, now + run.time(steps), steps, run, True, decode_seqs=len(out.work))
        else:
            if shape is None:
                shape = self._shape(out)
            step = self._step_time(shape, load, warm)
            self.inflight = _InFlight(out, now, now + step, decode=steady,
                                      decode_seqs=0 if shape.prefill_tokens else shape.num_decode)
        return self.inflight.end

    def _warmup(self, now: float, prompt: bool, steps: int = 1, beside: bool = False) -> tuple[float, int]:
        """(the price factor of a step or run starting at ``now``, with prompt tokens or not, for
        being that many steps after the engine woke from idling (``LinearCost.warmup``; 1 past
        the last bucket and for the GPU kinds), the steps it may run at that factor: ``steps``
        cut to its warm-up bucket's end). Idle ``warm_idle_s`` or more since the last step ended:
        this step wakes the engine; the decode steps after a wake by a prompt step (a new
        request's) and by a decode step (a hand-off's) have their own factors, each alone and
        ``beside`` the node's other engines' steps (the node's stepping count changing ends a
        run: ``Simulator._reprice_node``)."""
        if not self._warm_edges:
            return 1.0, steps
        if now - self._last_end >= self._warm_idle_s:
            self._since_wake, self._wake_prompt = 0, prompt
        k, edges = self._since_wake, self._warm_edges
        i = bisect_right(edges, k)
        if i >= len(edges):
            return 1.0, steps
        factors = self._warm_prompt if prompt else self._warm_decode[beside][self._wake_prompt]
        return factors[i], max(1, min(steps, edges[i] - k))

    def _after_prompt(self, shape: BatchShape) -> float:
        """A single step's price factor for the decode steps just after a step with prompt
        tokens (``LinearCost.post_prompt``: on this machine's engine the first decode step after
        a prefill runs ~1.2x, the next ~1.1x, beside the warm-up; runs of decode steps start
        after them), and the count of decode steps since one."""
        if shape.prefill_tokens:
            self._since_prompt = 0
            return 1.0
        self._since_prompt += 1
        return _nth_after(self._post_prompt, self._since_prompt - 1)

    def _step_time(self, shape: BatchShape, load, warm: float) -> float:
        """A step priced alone: its cost at the node's ``load``, a draw of its noise, the factors
        of the steps after a prompt step and after a landing, the warm-up's ``warm`` and, for a
        decode-only step, the engine's speed."""
        return (self.cost.step_time(shape, *load) * self.sink.step_factor(shape.prefill_tokens > 0, self)
                * self._after_prompt(shape) * self._after_landing() * warm
                * (1.0 if shape.prefill_tokens else self._speed))

    def _runs_priced(self) -> bool:
        """Whether decode steps may be priced as a run now: past the steps after a prompt step
        and after a landing, which are priced one at a time."""
        return self._since_prompt >= len(self._post_prompt) and self._since_landing >= len(self._post_landing)

    def _run(self, run, warm: float, steps: int, now: float):
        """(run, steps) of a decode run of up to ``steps`` starting at ``now``: at the warm-up's
        factor ``warm`` and the engine's speed, slowed (``_slowed``); counted."""
        f = warm * self._speed
        run, steps = self._slowed(run.scaled(f) if f != 1.0 else run, steps, now)
        self.num_runs += 1
        self._since_prompt += steps
        self._since_landing += steps
        return run, steps

    def _after_landing(self) -> float:
        """A single step's price factor for the steps just after a page set landed mid-step
        (``LinearCost.post_landing``; runs of steps start after them), and the count of steps
        since one."""
        self._since_landing += 1
        return _nth_after(self._post_landing, self._since_landing - 1)

    def _slowed(self, run, steps: int, now: float):
        """(run, steps) of a decode run starting at ``now``, times the engine's slowness then
        (``Simulator.run_scale``: the cpu kind's slow stretches in a replay; else unchanged),
        ending by the step that crosses the end of the slowness's window, where the next run is
        priced with the next window's."""
        m, until = self.sink.run_scale(self, now)
        if m != 1.0:
            run = run.scaled(m)
        if until is not None and now + run.time(steps) > until:
            steps = run.steps_within(until - now, steps)
        return run, steps

    # ---- the lazy steady batch (``steady_batch.py``) -------------------------------------------
    def _enter_lazy(self, work: list) -> bool:
        """Make a steady step's branches (their blocks for the step taken) a lazy batch, if they
        are in running order (priority, arrival, branch): the order finishes are applied in."""
        prev = None
        for w in work:
            key = (w.request.priority, w.request.arrival, w.seq.index)
            if prev is not None and key <= prev:
                return False  # a step that admitted an urgent request lists it last
            prev = key
        b, targets = SteadyBatch(self.bm), self.targets
        self._admitted = None
        for w in work:
            lens, token = targets[w.request.request_id]
            b.add(w.request, w.seq.index, w.seq, token, lens[w.seq.index])
        self.batch = b
        self._left, self._ctx = b.left(), b.ctx
        return True

    def _steady_plan(self, out: ScheduleOutput) -> bool:
        """``schedule()`` gave every running branch exactly its sampled token, admitted and
        preempted nothing, copies and swaps nothing, and what is queued sorts behind the running."""
        s, p = self.scheduler, out.plan
        if (out.preempted or out.out_of_capacity or p.blocks_to_copy or p.blocks_to_swap_in or p.blocks_to_swap_out
                or p.swap_ins or p.swap_outs or not s.queue_is_behind_running()):
            return False
        for w in out.work:
            if w.num_tokens != 1 or not w.samples or len(w.seq.token_ids) == w.seq.num_prompt_tokens:
                return False
        return len(out.work) == s.num_running_seqs()

    def _lazy_next(self, joined: list[Request]) -> bool:
        """``_steady_decode`` for a lazy batch: the batch's branches each have their sampled token
        to compute by construction, so only the requests that joined (imports) are checked and
        only the blocks of the step are taken. False: the batch is settled, the eager path decides."""
        s, bm, b = self.scheduler, self.bm, self.batch
        queued = bool(s.waiting or s.swapped)
        ok = not (self._imports_may_start() or self.inbox) and bool(s.running)
        new = []
        if ok:
            for req in joined:
                if req.status is not RequestStatus.RUNNING or req.needs_fork:
                    ok = False
                    break
                last = -1
                for seq in req.seqs:
                    if seq.finish_reason is None:
                        n = len(seq.token_ids)
                        if n - seq.num_computed_tokens != 1 or n == seq.num_prompt_tokens or seq.index <= last:
                            ok = False
                            break
                        last = seq.index
                        new.append((req, seq))
                if not ok:
                    break
        size = len(b) + len(new)
        ok = ok and 0 < size <= self.config.max_num_batched_tokens  # (see _steady_decode on max_num_seqs)
        growing = []
        if ok:
            bs, rc = bm.block_size, bm.ref_count
            for _, seq in new:
                i = seq.num_computed_tokens // bs
                if i >= len(seq.block_table):
                    growing.append(seq)
                elif rc[seq.block_table[i]] > 1:
                    ok = False  # copy-on-write: the scheduler plans the copy
                    break
        # A queue ahead of a running request: schedule() may preempt for it, or admit it inside
        # the running order (the lazy batch finishes branches in running order).
        if not ok or b.growing() + len(growing) > bm.num_free_blocks or (queued and not s.queue_is_behind_running()):
            self.settle()
            return False
        b.take(b.growing())
        for seq in growing:
            if bm.append_slots(seq):
                raise RuntimeError(f"copy-on-write in a steady decode step (seq {seq.seq_id})")
        b.lead = 1
        targets = self.targets
        for req, seq in new:
            lens, token = targets[req.request_id]
            b.add(req, seq.index, seq, token, lens[seq.index])
        self._left, self._ctx = b.left(), b.ctx
        self._admitted = None
        if queued:  # the real scheduler's admission, behind the batch's branches
            n = len(s.running)
            out = s.admit(len(b))
            if len(s.running) > n:
                self._admitted = (out, s.running[n:])
        return True

    def _start_lazy(self, now: float) -> float:
        """The next decode step or run of the lazy batch (as ``_start`` for a steady step)."""
        b = self.batch
        size = len(b)
        load = self.sink.node_load(self.node) if self.cost.shares_cores else _ALONE
        if self._admitted is not None:
            # A step that admitted requests: one step, the batch's branches plus their prompts
            # (an admitted request with no room for its chunk yet computes from the next step).
            out, admitted = self._admitted
            self._prefilling, self._num_running_seqs = admitted, None
            pt, pc, nd, dc = out.plan.batch_shape()
            shape = BatchShape(pt, pc, nd + size, dc + self._ctx)
            step = self._step_time(shape, load, self._warmup(now, pt > 0, beside=load[0] > 0)[0])
            self.inflight = _InFlight(out, now, now + step, decode=True, lazy=True,
                                      decode_seqs=0 if pt else shape.num_decode)
            return self.inflight.end
        self._prefilling = ()
        self._num_running_seqs = size
        steps = max(1, min(self._left, b.steps_until_full(self._left)))
        warm, steps = self._warmup(now, False, steps, load[0] > 0)
        if steps > 1 and self._runs_priced():
            run, steps = self._run(self.cost.decode_run(size, self._ctx, *load), warm, steps, now)
            self.inflight = _InFlight(None, now, now + run.time(steps), steps, run, True, True, decode_seqs=size)
        else:
            shape = BatchShape(0, 0, size, self._ctx)
            step = self._step_time(shape, load, warm)
            self.inflight = _InFlight(None, now, now + step, decode=True, lazy=True, decode_seqs=size)
        return self.inflight.end

    def _complete_lazy(self, f: _InFlight, now: float) -> None:
        self.num_steps += f.steps
        sched, sink = self.scheduler, self.sink
        size = len(self.batch)      # (the branches the step decoded beside what it admitted)
        for m in self.batch.run_end(f.steps):
            sched.finish_seq(m.req, m.seq, "length")
            sink.on_seq_finished(self, m.req, m.seq, now)
        if f.out is not None:  # what the step admitted: applied as any step's, after the batch's
            self._apply_step(f.out, now, steady_check=False, beside=size)
            self._joined += [r for r in self._admitted[1] if r.status is RequestStatus.RUNNING]

    def settle(self) -> None:
        """Materialize the lazy batch's branches and run eagerly from here on (until the next
        steady step): the real scheduler is about to read them."""
        if self.batch is not None:
            self.batch.settle()
            self.batch = None

    def output_tokens(self, seq) -> int:
        """Output tokens of a branch here, as of the last step boundary (lazy or not)."""
        b = self.batch
        m = None if b is None else b.members.get(seq.seq_id)
        return len(seq.token_ids) - seq.num_prompt_tokens + (0 if m is None else b.clock - m.sync)

    def _steady_next(self, work: list) -> ScheduleOutput | None:
        """``_steady_decode`` after a decode step or run over every running branch, when nothing
        changed since but branches finishing: each branch left has exactly its sampled token to
        compute, in a block it owns (it wrote the previous position itself) or a new one. So the
        premise holds again once nothing is queued and the new blocks fit; only they are taken."""
        s, bm = self.scheduler, self.bm
        if s.waiting or s.swapped or not work:
            return None
        bs = bm.block_size
        growing = [w.seq for w in work if w.seq.num_computed_tokens // bs >= len(w.seq.block_table)]
        if len(growing) > bm.num_free_blocks:
            return None  # the scheduler would preempt
        for seq in growing:
            if bm.append_slots(seq):
                raise RuntimeError(f"copy-on-write in a steady decode step (seq {seq.seq_id})")
        out = ScheduleOutput()
        out.work = work
        return out

    def _steady_decode(self) -> ScheduleOutput | None:
        """The next step when the scheduler has no choice to make, else None (ask it).

        Nothing is queued, waiting to import, or to be cancelled or moved; every running branch
        has exactly one token to compute; the batch fits the token budget; and the blocks those
        tokens go into fit the free blocks without copy-on-write. Then ``Scheduler.schedule``
        would preempt nothing, admit nothing, and give every running branch its one token, in
        running order: that is this step (its blocks taken with the real ``append_slots``). This
        is the decode run's own premise (the same step repeats until something differs), applied
        after a branch finishes or a prefill completes, where a schedule() pass over the whole
        batch was most of a large simulation's time. ``test_bulk_decode_runs_equal_step_by_step``
        checks it against a schedule() call per step."""
        s, bm = self.scheduler, self.bm
        if (self.role == "prefill" or s.waiting or s.swapped or self._imports_may_start() or self.inbox
                or not s.running):
            return None
        work, seqs = [], []
        targets, left, ctx = self.targets, MAX_RUN_STEPS, 0
        for req in s.running:
            if req.status is not RequestStatus.RUNNING or req.needs_fork:
                return None
            lens = targets[req.request_id][0]
            for seq in req.seqs:
                if seq.finish_reason is None:
                    n, c = len(seq.token_ids), seq.num_computed_tokens
                    if n - c != 1 or n == seq.num_prompt_tokens:
                        return None
                    seqs.append(seq)
                    work.append(ScheduledWork(req, seq, 1, True))
                    ctx += n
                    n = lens[seq.index] - (n - seq.num_prompt_tokens)
                    if n < left:
                        left = n
        # Not max_num_seqs: it limits admission only (of imports too: ``Scheduler.reserve_import``),
        # and schedule() gives every running branch its token.
        if len(seqs) > self.config.max_num_batched_tokens:
            return None
        bs, rc, growing = bm.block_size, bm.ref_count, []
        for seq in seqs:
            i = seq.num_computed_tokens // bs
            if i >= len(seq.block_table):
                growing.append(seq)
            elif rc[seq.block_table[i]] > 1:
                return None  # copy-on-write: the scheduler plans the copy
        if len(growing) > bm.num_free_blocks:
            return None  # the scheduler would preempt
        for seq in growing:  # for the others append_slots has nothing to do
            if bm.append_slots(seq):
                raise RuntimeError(f"copy-on-write in a steady decode step (seq {seq.seq_id})")
        self._left, self._ctx = left, ctx
        out = ScheduleOutput()
        out.work = work
        return out

    @staticmethod
    def _shape(out: ScheduleOutput) -> BatchShape:
        if out.plan.seqs:
            return BatchShape(*out.plan.batch_shape())  # as the cluster's step telemetry reports it
        # ``_steady_decode``'s step has no plan: one token per running branch.
        return BatchShape(0, 0, len(out.work), sum(w.seq.num_computed_tokens + 1 for w in out.work))

    def _run_length(self, out: ScheduleOutput, steady: bool = False) -> int:
        """How many identical decode steps, starting with ``out``, can run before anything differs.
        ``steady``: ``out`` is a steady step's, whose batch was checked (and ``_left`` found)."""
        s = self.scheduler
        work = out.work
        if steady:
            return max(1, min(self._left, self._steps_until_full(out, self._left)))
        if self.role == "prefill" or out.preempted or out.out_of_capacity or out.plan.blocks_to_copy:
            return 1
        if not work or work[-1].num_tokens != 1:  # a step admitting a request ends with its prompt
            return 1
        if len(work) != sum(len(r.unfinished_seqs) for r in s.running):
            return 1
        queued = s.waiting[:1] + s.swapped[:1]
        if queued and s.running and s.running[-1].priority > min(r.priority for r in queued):
            return 1  # an urgent arrival may preempt at any step
        steps = MAX_RUN_STEPS
        targets = self.targets
        for w in work:
            seq = w.seq
            if w.num_tokens != 1 or not w.samples:
                return 1
            left = targets[w.request.request_id][0][seq.index] - (len(seq.token_ids) - seq.num_prompt_tokens)
            if left < steps:
                steps = left
        if steps < 1 or any(len(w.seq.token_ids) == w.seq.num_prompt_tokens for w in work):
            return 1
        return max(1, min(steps, self._steps_until_full(out, steps)))

    def _steps_until_full(self, out: ScheduleOutput, hi: int) -> int:
        """The most steps (<= hi) whose new blocks fit the free blocks (the first step's are taken)."""
        bs, free = self.bm.block_size, self.bm.num_free_blocks
        # Each branch holds the blocks of the run's first step: k steps need at most
        # ceil((k - 1) / bs) more each.
        if len(out.work) * -(-(hi - 1) // bs) <= free:
            return hi
        seqs = [(w.seq.num_computed_tokens, len(w.seq.block_table)) for w in out.work]

        def need(k: int) -> int:
            return sum(max(0, -(-(c + k) // bs) - nb) for c, nb in seqs)

        if need(hi) <= free:  # the common case: no KV pressure within the run
            return hi
        lo = 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if need(mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _complete(self, f: _InFlight, now: float) -> list | None:
        """Apply the finished step (or run): tokens, blocks, first tokens, finishes. Returns the
        work of the next step when it is steady and known from this one (see ``_steady_next``)."""
        if f.decode_seqs:       # (a run cut short at an interruption counts the steps it ran)
            n, seconds, seqs = self.decode_step_totals
            self.decode_step_totals = (n + f.steps, seconds + (f.end - f.start), seqs + f.decode_seqs * f.steps)
        if f.lazy:
            return self._complete_lazy(f, now)
        if f.decode:
            return self._complete_decode(f, now)
        self.num_steps += 1
        return self._apply_step(f.out, now)

    def _apply_step(self, out: ScheduleOutput, now: float, steady_check: bool = True, beside: int = 0) -> list | None:
        """``beside``: the branches of a lazy batch the step decoded besides ``out``'s work."""
        self.scheduler.on_computed(out)
        targets, sink = self.targets, self.sink
        prefill = self.role == "prefill"
        progressed: dict[str, Request] = {}
        # Every branch that sampled has exactly its sample to compute next: if they are all the
        # running branches, the next step is steady (each decoding one token), as after a run.
        going_on = None if prefill or out.preempted or not steady_check else []
        prompted = []  # of those, the branches that computed (a chunk of) their prompt
        left, ctx = MAX_RUN_STEPS, 0
        decoded = None  # the step's decoding sequences (its batch shape's), once a first token asks
        for w in out.work:
            if not w.samples:
                going_on = None
                continue
            seq, req = w.seq, w.request
            lens, token = targets[req.request_id]
            seq.token_ids.append(token)
            produced = len(seq.token_ids) - seq.num_prompt_tokens
            if produced == 1:
                if decoded is None:
                    decoded = out.plan.batch_shape()[2] + beside
                others = decoded - (1 if w.num_tokens == 1 else 0)     # (a one-token prompt counts as decoding)
                sink.on_first_token(self, req, seq, now, beside=others > 0)
            if prefill:
                progressed[req.request_id] = req
            if produced >= lens[seq.index]:
                self.scheduler.finish_seq(req, seq, "length")
                sink.on_seq_finished(self, req, seq, now)
            elif going_on is not None:
                if w.num_tokens != 1:
                    prompted.append(seq)
                    w = ScheduledWork(req, seq, 1, True)
                going_on.append(w)
                ctx += len(seq.token_ids)
                left = min(left, lens[seq.index] - produced)
        if going_on is not None:
            return self._covers_running(going_on, prompted, left, ctx)
        if prefill:
            for req in progressed.values():
                if self.scheduler.prefill_done(req):
                    self.scheduler.hold(req)
                    self.sink.on_prefilled(self, req, now)
        return None

    def _covers_running(self, work: list, prompted: list, left: int, ctx: int) -> list | None:
        """``work`` if it holds every running branch (it holds only running ones) and no branch
        that just computed its prompt (``prompted``) writes next into a block shared
        copy-on-write (a decoding branch writes on into the block it wrote last, its own)."""
        s, bm = self.scheduler, self.bm
        if len(work) != s.num_running_seqs() or len(work) > self.config.max_num_batched_tokens:
            return None
        bs, rc = bm.block_size, bm.ref_count
        for seq in prompted:
            i = seq.num_computed_tokens // bs
            if i < len(seq.block_table) and rc[seq.block_table[i]] > 1:
                return None
        self._left, self._ctx = left, ctx
        return work

    def _complete_decode(self, f: _InFlight, now: float) -> list | None:
        """A decode step or run of k steps over every running branch, each computing one token
        a step and sampling it: the run's steps computed the token sampled before it and the
        tokens sampled by its steps 1..k-1; the last step's sample is appended, as after any
        step. What ``Scheduler.on_computed`` does for such a step is done here in bulk (the
        computed count, the blocks the tokens fill, the prefix-cache offers); one pass over the
        batch, which also collects the branches that go on."""
        k = f.steps
        self.num_steps += k
        targets, bm, sink, sched = self.targets, self.bm, self.sink, self.scheduler
        bs, caching = bm.block_size, bm.enable_prefix_caching
        if caching:  # offers in the engine's order: every branch's first token, then the rest
            sched.on_computed(f.out)
            first = 0
        else:
            first = 1
        going_on, finished = [], []
        left, ctx = MAX_RUN_STEPS, 0
        for w in f.out.work:
            seq, req = w.seq, w.request
            lens, token = targets[req.request_id]
            tokens = seq.token_ids
            if k > 1:
                tokens.extend(repeat(token, k - 1))
                if (len(tokens) - 1) // bs >= len(seq.block_table) and bm.append_slots(seq) != []:
                    raise RuntimeError(f"copy-on-write or no room inside a decode run (seq {seq.seq_id})")
            seq.num_computed_tokens += k - 1 + first
            if caching:
                bm.register_computed_blocks(seq)
            tokens.append(token)
            produced = len(tokens) - seq.num_prompt_tokens
            if produced == 1:
                sink.on_first_token(self, req, seq, now, beside=len(f.out.work) > 1)
            to_go = lens[seq.index] - produced
            if to_go <= 0:
                finished.append(w)
            else:
                going_on.append(w)
                ctx += len(tokens)  # = computed + 1: the positions the next step attends to
                if to_go < left:
                    left = to_go
        # Branches finish (and free their blocks) after every branch took the blocks of the run's
        # steps, as in the engine, where a step's blocks are taken before it runs: freed first,
        # they would be taken instead of evicting cached blocks (the prefix cache would differ).
        for w in finished:
            sched.finish_seq(w.request, w.seq, "length")
            sink.on_seq_finished(self, w.request, w.seq, now)
        self._left, self._ctx = left, ctx
        return going_on if self.role != "prefill" else None

    def release(self, request_id: str) -> None:
        """Free an exported request's blocks (its KV lives on elsewhere now)."""
        if self.batch is not None and request_id in self.scheduler.requests:
            self.batch.settle_request(self.scheduler.requests[request_id])
        self.scheduler.abort(request_id)
        self.targets.pop(request_id, None)
        self.touch()

    def forget(self, request_id: str) -> None:
        self.targets.pop(request_id, None)

    def _account_kv(self, now: float) -> None:
        self.kv_block_seconds += (self.bm.num_blocks - self.bm.num_free_blocks) * (now - self._kv_t)
        self._kv_t = now

    def check_integrity(self) -> None:
        s = self.scheduler
        if s.num_running_seqs() != s.recount_running_seqs():
            raise AssertionError(f"{self.instance_id}: the scheduler counts {s.num_running_seqs()} running branches, "
                                 f"its running requests hold {s.recount_running_seqs()}")
        tables = list(self.scheduler.block_tables())
        if self.batch is not None:  # blocks taken for lazy branches, not yet in their tables
            tables.append(self.batch.spare)
        self.bm.check_integrity(tables, list(self.scheduler.host_block_tables()))
