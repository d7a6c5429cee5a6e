"""How late the frontend's event loop runs: an always-on ticker.

Everything the frontend does (gRPC streams, HTTP, instance polls, placement, predictor refits)
runs as callbacks of one asyncio loop, so a callback that runs long delays every other one: a
request that arrives meanwhile waits before it is even admitted. The gauge measures that delay
directly, as the lateness of a timer that should fire every ``interval_s``::

    expected wake ─┐          ┌─ actual wake
                   ▼          ▼
    ───sleep(interval)────────|~~~~ lag ~~~~|───   lag = actual - expected (≥ 0)

A lag above ``stall_s`` is a *stall*; the last ``keep`` stalls are kept with their times (the
machine's monotonic clock, which the instances' step traces also use), so a bench can line a
slow request up with the stall it waited behind. Cost: one timer wake per ``interval_s``.
"""
from __future__ import annotations

import asyncio
import bisect
import time
from collections import deque
from dataclasses import dataclass

# Upper bounds of the lag histogram (seconds); the last bucket is everything above.
LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass(frozen=True)
class LoopLagSummary:
    """What the gauge has seen since it started."""

    ticks: int
    stalls: int             # ticks late by at least ``stall_s``
    max_ms: float
    mean_ms: float
    buckets: tuple[int, ...]    # ticks per LAG_BUCKETS bound (non-cumulative), then the overflow


class LoopLag:
    def __init__(self, interval_s: float = 0.01, stall_s: float = 0.02, keep: int = 4096):
        self.interval_s = interval_s
        self.stall_s = stall_s
        self.ticks = 0
        self.total_s = 0.0
        self.max_s = 0.0
        self.counts = [0] * (len(LAG_BUCKETS) + 1)
        self.stalls: deque[tuple[float, float]] = deque(maxlen=keep)   # (woke at, lag s)
        self.num_stalls = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        clock, interval = time.monotonic, self.interval_s
        while True:
            expected = clock() + interval
            await asyncio.sleep(interval)
            now = clock()
            self.record(now, max(0.0, now - expected))

    def record(self, at: float, lag_s: float) -> None:
        """One tick that woke at ``at``, ``lag_s`` late."""
        self.ticks += 1
        self.total_s += lag_s
        if lag_s > self.max_s:
            self.max_s = lag_s
        self.counts[bisect.bisect_left(LAG_BUCKETS, lag_s)] += 1
        if lag_s >= self.stall_s:
            self.num_stalls += 1
            self.stalls.append((at, lag_s))

    def summary(self) -> LoopLagSummary:
        return LoopLagSummary(self.ticks, self.num_stalls, self.max_s * 1e3,
                              self.total_s / self.ticks * 1e3 if self.ticks else 0.0, tuple(self.counts))

    def stalls_since(self, t: float) -> list[tuple[float, float]]:
        """The kept stalls that woke at or after ``t``: (woke at, lag in seconds); a stall began
        at ``woke at - lag``."""
        return [s for s in self.stalls if s[0] >= t]
