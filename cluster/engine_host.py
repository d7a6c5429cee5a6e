"""One engine driven by a background thread, with thread-safe control methods.

    control calls (actor's asyncio loop)         engine thread
      add / abort / export / import ──lock──▶   ┌──────────────────────────────┐
      stats / drain                              │ loop: lock; step(); unlock    │
                                                 │       publish deltas → outbox │
      poll() ◀──────── outbox (deltas) ──────────└──────────────────────────────┘

The engine is not thread-safe, so every call into it holds ``lock``; the thread releases it
between steps, so a control call waits at most one step. No Ray here: the actor in
``instance.py`` wraps this class, and the KV receiver thread shares the same lock.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Sequence

from thinkserve.kvtransfer.telemetry import TELEMETRY
from thinkserve.workers.prefix_journal import PrefixCursor, PrefixDelta
from thinkserve.workers.sampling_params import SamplingParams

from .messages import BranchDelta, InstanceStats, PartDelta
from .step_telemetry import StepTelemetry

log = logging.getLogger(__name__)


class EngineHost:
    def __init__(self, instance_id: str, engine, *, nice: int = 0, cpus: tuple[int, ...] = ()) -> None:
        self.instance_id = instance_id
        self.engine = engine
        self.nice = nice                     # raised on the engine thread (pools.<name>.nice)
        self.cpus = cpus                     # the engine thread's cores (pools.<name>.cpus; () any)
        self.lock = threading.RLock()
        self._outbox: list[PartDelta] = []
        self._outbox_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._on_output: Callable[[], None] | None = None
        self.admitting = True
        self.held_poll_s = 0.002             # step interval while only held / exported requests remain
        self.error: str | None = None        # set when the engine raised: the instance is unhealthy
        self.parts: set[str] = set()         # engine requests this instance holds
        self._finish_sent: dict[str, set[int]] = {}
        self.generated_tokens = 0
        self.steps = 0
        self.store_prefix_blocks = 0         # prefix blocks the KV endpoint loaded from the CPU store
        self.telemetry = StepTelemetry()     # step durations and part timings (the simulator's fit)
        self.decode_step_totals = (0, 0.0, 0)  # decode-only steps: count, seconds, branches (one tuple: read whole)
        self._published_stats: InstanceStats | None = None   # latest_stats(): the loop's, lock-free
        self.swap_space = getattr(engine, "swap_space", None)   # the engine's (the node's CPU store), if any
        self._thread = threading.Thread(target=self._loop, name=f"engine-{instance_id}", daemon=True)

    def start(self, on_output: Callable[[], None] | None = None) -> None:
        self._on_output = on_output
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    # ----------------------------------------------------------------- engine thread
    def _loop(self) -> None:
        if self.nice:
            _raise_niceness(self.nice)
        if self.cpus:                        # the calling thread only (Linux: a per-thread mask)
            try:
                os.sched_setaffinity(0, self.cpus)
            except OSError as e:             # checked at start (instance.check_cores); the node changed
                self.error = f"could not bind the engine thread to cores {list(self.cpus)}: {e}"
                log.error("%s: %s", self.instance_id, self.error)
                return
        while not self._stop.is_set():
            t0 = time.monotonic()    # a step's telemetry counts its wait for the lock and its publishing
            try:
                with self.lock:
                    busy = self.engine.has_unfinished_requests()
                    self.engine.last_plan = None
                    outputs = self.engine.step() if busy else []
                    plan = self.engine.last_plan
                    if outputs:
                        self.steps += 1
                        deltas = [d for d in (self._to_delta(o) for o in outputs) if d is not None]
                    else:
                        deltas = []
                    self._published_stats = self.stats()     # the lock is re-entrant
            except Exception as e:  # a broken invariant: stop stepping, report unhealthy
                log.exception("engine step failed on %s", self.instance_id)
                self.error = f"{type(e).__name__}: {e}"
                return
            if deltas:
                self._publish(deltas)
                # Yield the GIL right after releasing the lock: a receiver thread or control call
                # waiting for it gets it now, instead of losing it to the next step (starvation).
                time.sleep(0)
            elif plan is not None and not plan.is_empty:
                # Computed without a sample (a prompt chunk before the prompt's last):
                # step again at once, as after a step with outputs.
                time.sleep(0)
            elif busy:
                # Only held / exported requests (waiting for a transfer): nothing to compute.
                self._wake.wait(self.held_poll_s)
                self._wake.clear()
            else:
                self._wake.wait(0.05)
                self._wake.clear()
            if plan is not None and not plan.is_empty:
                step = self.telemetry.step(t0, time.monotonic() - t0, plan)
                if step.prefill_tokens == 0 and step.num_decode:    # a TPOT measurement
                    n, secs, seqs = self.decode_step_totals
                    self.decode_step_totals = (n + 1, secs + step.duration, seqs + step.num_decode)

    def _to_delta(self, out) -> PartDelta | None:
        sent = self._finish_sent.setdefault(out.request_id, set())
        branches = []
        for c in out.outputs:
            new = tuple(int(t) for t in c.new_token_ids)
            first_finish = c.finish_reason is not None and c.index not in sent
            if not new and not first_finish:
                continue
            if first_finish:
                sent.add(c.index)
            self.generated_tokens += len(new)
            hidden = getattr(c, "hidden_state", None)
            branches.append(BranchDelta(c.index, len(c.token_ids) - len(new), new, c.finish_reason,
                                        None if hidden is None else tuple(hidden)))
        prefilled = bool(getattr(out, "prefilled", False))
        first = any(len(c.token_ids) == len(c.new_token_ids) and c.new_token_ids for c in out.outputs)
        if first or out.finished:
            self.telemetry.published(out.request_id, time.monotonic(), first_token=first, finished=out.finished)
        if out.finished:
            self.parts.discard(out.request_id)
            self._finish_sent.pop(out.request_id, None)
        if not branches and not prefilled and not out.finished:
            return None
        return PartDelta(out.request_id, tuple(branches), prefilled, bool(out.finished))

    def _publish(self, deltas: list[PartDelta]) -> None:
        with self._outbox_lock:
            self._outbox.extend(deltas)
        if self._on_output is not None:
            self._on_output()

    def take_outputs(self) -> tuple[PartDelta, ...]:
        with self._outbox_lock:
            out, self._outbox = self._outbox, []
        return tuple(out)

    def has_outputs(self) -> bool:
        return bool(self._outbox)

    def wake(self) -> None:
        self._wake.set()

    # ----------------------------------------------------------------- control
    def add(self, part_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, priority: int,
            reserve: tuple[str, tuple[int, ...]] | None = None) -> None:
        """Raises ``ValueError`` (bad input) or ``KeyError`` (duplicate part id). ``reserve``:
        (part id, branches) held here once the prompt is computed (``LLMEngine.add_request``)."""
        arrived = time.monotonic()   # before waiting for the step in flight (which the simulator models)
        with self.lock:
            if part_id in self.parts or (reserve is not None and reserve[0] in self.parts):
                raise KeyError(f"request {part_id!r} already exists on {self.instance_id}")
            self.engine.add_request(part_id, list(prompt_token_ids), params, priority=priority, reserve=reserve)
            self.parts.add(part_id)
            if reserve is not None:
                self.parts.add(reserve[0])
            self.telemetry.added(part_id, arrived)
        self.wake()

    def try_add(self, part_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, priority: int,
                reserve: tuple[str, tuple[int, ...]] | None = None) -> bool:
        """``add`` now if no step is in flight (the engine lock is free), so the caller's thread
        need not hand it to another; False: the lock is busy and nothing was done."""
        if not self.lock.acquire(blocking=False):
            return False
        try:
            self.add(part_id, prompt_token_ids, params, priority, reserve)
        finally:
            self.lock.release()
        return True

    def abort(self, part_id: str) -> bool:
        with self.lock:
            self.parts.discard(part_id)
            self._finish_sent.pop(part_id, None)
            return bool(self.engine.abort(part_id))

    def abort_branches(self, part_id: str, indices: Sequence[int]) -> tuple[int, ...]:
        """Early consensus: end some branches of a part now (``LLMEngine.abort_branches``); the
        part goes on with the rest. Naming all of them aborts the part."""
        with self.lock:
            if part_id not in self.parts:
                return ()
            done = self.engine.abort_branches(part_id, indices)
            if not self.engine.has_request(part_id):
                self.parts.discard(part_id)
                self._finish_sent.pop(part_id, None)
            return done

    def fork_held(self, part_id: str, new_part_id: str, indices: Sequence[int], *, reserve: bool = False,
                  start: bool = False) -> bool:
        """Early consensus: branches ``indices`` of a part's prompt as the new part
        ``new_part_id``, sharing its prompt KV (``LLMEngine.fork_held``): held, or running here
        when ``start``; ``reserve``: the engine frees it when it needs the blocks. False:
        ``part_id`` holds no prompt KV here (gone, not prefilled yet, handed off, reclaimed)."""
        with self.lock:
            if part_id not in self.parts or new_part_id in self.parts:
                return False
            try:
                self.engine.fork_held(part_id, new_part_id, tuple(indices), reserve=reserve, start=start)
            except KeyError:
                return False
            self.parts.add(new_part_id)
        if start:
            self.wake()
        return True

    def prefix_delta(self, since: PrefixCursor) -> PrefixDelta:
        """The prefix blocks the engine's cache gained and evicted since ``since``. Once the
        journal runs this reads it without the engine lock (a poll must not wait for a step)."""
        bm = self.engine.block_manager
        if bm.prefix_journal is not None:
            return bm.prefix_journal.since(since)
        with self.lock:
            return bm.prefix_delta(since)

    def published(self, since: PrefixCursor | None) -> tuple[InstanceStats, PrefixDelta | None] | None:
        """What a poll returns beside its deltas, when reading it cannot block on the engine lock
        (the loop has published stats; the prefix journal runs, if asked): the caller may read
        it on its own event loop. None: read ``latest_stats``/``prefix_delta`` on a thread."""
        s = self._published_stats
        if s is None:
            return None
        if since is None:
            return s, None
        journal = self.engine.block_manager.prefix_journal
        return None if journal is None else (s, journal.since(since))

    def latest_stats(self) -> InstanceStats:
        """The stats as of the end of the engine loop's last iteration (each step, or every
        50 ms idle), without waiting for the step in flight: what a poll returns."""
        s = self._published_stats
        return s if s is not None else self.stats()

    def stats(self) -> InstanceStats:
        with self.lock:
            s = self.engine.stats()
        decode_steps, decode_seconds, decode_seqs = self.decode_step_totals
        return InstanceStats(
            self.instance_id,
            num_waiting=int(getattr(s, "num_waiting", 0)), num_running=int(getattr(s, "num_running", 0)),
            num_swapped=int(getattr(s, "num_swapped", 0)), num_held=int(getattr(s, "num_held", 0)),
            num_free_blocks=int(getattr(s, "num_free_blocks", 0)),
            num_total_blocks=int(getattr(s, "num_total_blocks", getattr(s, "num_blocks", 0))),
            generated_tokens=self.generated_tokens, num_parts=len(self.parts), admitting=self.admitting,
            steps=self.steps, prefix_cache_hit_rate=float(getattr(s, "prefix_cache_hit_rate", 0.0)),
            store_prefix_blocks=self.store_prefix_blocks,
            recomputed_tokens=int(getattr(s, "num_recomputed_tokens", 0)),
            num_preemptions=int(getattr(s, "num_preemptions", 0)),
            store_swap_outs=self.swap_space.num_puts if self.swap_space is not None else 0,
            store_swap_refused=self.swap_space.num_refused if self.swap_space is not None else 0,
            num_recompute_preemptions=int(getattr(s, "num_recompute_preemptions", 0)),
            queued_prefill_tokens=int(getattr(s, "num_queued_prefill_tokens", 0)),
            num_running_seqs=int(getattr(s, "num_running_seqs", 0)),
            kv_transfers=TELEMETRY.totals(),
            decode_steps=decode_steps, decode_step_seconds=decode_seconds, decode_step_seqs=decode_seqs)


def _raise_niceness(by: int) -> None:
    """Raise the calling thread's niceness (on Linux a per-thread attribute, which threads it
    starts inherit); raising needs no privileges."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, min(19, os.getpriority(os.PRIO_PROCESS, 0) + by))
    except (AttributeError, OSError) as e:      # not Linux/Unix, or refused
        log.warning("could not raise the engine thread's niceness by %d: %s", by, e)
