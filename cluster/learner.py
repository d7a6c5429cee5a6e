"""The Conductor's learning, off the frontend's critical path.

Training the length predictor is the longest work the frontend's event loop does: a finished
Best-of-8 request with 16 decode hidden states per branch is ~140 SGD steps, 10-80 ms run in one
callback. Every gRPC stream, instance poll and placement waits behind such a callback (a new
request waited up to its whole length before it was even placed). The learner queues that work
(``submit``: an iterator, one step per ``next``) and runs it one step per event-loop turn, after
whatever else is ready, and not at all while a request is on its way to its first token (``hold``
/ ``release`` around a request's way from its arrival to its first token's reaching the frontend:
its placement, its dispatch, the poll that brings the token, the stream that sends it)::

    poll reply ─▶ dispatch ─▶ learner.submit(steps)      (returns at once)
    loop turn: ready callbacks ... ─▶ one step ─▶ ready callbacks ... ─▶ one step ...
                                      (none while a request waits for its first token)

A hold that lasts longer than ``max_hold_s`` (a request stuck before its first token) lets one
step through per ``max_hold_s``, so learning never stops for good.

The order of the steps is the order they were submitted in, so the predictor learns exactly what
it learned inline, only later. ``idle`` waits until the queue is empty.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator

log = logging.getLogger(__name__)


def one_step(fn: Callable[[], object]) -> Iterator[None]:
    """``fn`` as a single learning step."""
    fn()
    yield


class Learner:
    def __init__(self, spawn: Callable[[object], asyncio.Task], max_hold_s: float = 1.0):
        self._spawn = spawn                 # the orchestrator's: its idle() waits for the learner too
        self.max_hold_s = max_hold_s
        self._work: deque[Iterator] = deque()
        self._holds = 0
        self._free = asyncio.Event()
        self._free.set()
        self._task: asyncio.Task | None = None
        self.steps = 0                      # steps run since start

    @property
    def pending(self) -> int:
        """Work items queued (a finished branch's refit is one)."""
        return len(self._work)

    def submit(self, steps: Iterable[object]) -> None:
        """Queue ``steps`` (run one per ``next``) behind the work already queued."""
        self._work.append(iter(steps))
        if self._task is None:
            self._task = self._spawn(self._run())

    def hold(self) -> None:
        """A request waits for its first token: no learning step runs until it is released."""
        self._holds += 1
        self._free.clear()

    def release(self) -> None:
        self._holds -= 1
        if self._holds <= 0:
            self._holds = 0
            self._free.set()

    async def idle(self) -> None:
        """Until every queued step has run."""
        while self._task is not None:
            await asyncio.shield(self._task)

    async def _run(self) -> None:
        work = self._work
        try:
            while work:
                await asyncio.sleep(0)          # what is ready runs first: one step per loop turn
                if self._holds:
                    try:
                        await asyncio.wait_for(self._free.wait(), self.max_hold_s)
                        continue
                    except asyncio.TimeoutError:
                        pass                    # held too long: one step goes through
                try:
                    next(work[0])
                    self.steps += 1
                except StopIteration:
                    work.popleft()
                except Exception:               # a broken update must not stop the others
                    log.exception("a learning step failed")
                    work.popleft()
        finally:
            self._task = None
