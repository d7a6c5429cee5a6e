"""Step telemetry of one instance: when each engine step ran, how long it took, what it computed;
when each part arrived and when its first and last tokens were published.

The simulator's ``cpu`` kind is fitted from it (``bench/fit_sim_cpu.py``): a step's duration
against its batch shape and how many other engines on the node were stepping at the same time,
and the frontend's dispatch and streaming latencies against the client's own timestamps. Times
are ``time.monotonic()``, one clock for every process on a machine. Bounded: the oldest records
go first; ``take`` hands over what is there and starts afresh.
"""
from __future__ import annotations

import threading
from collections import OrderedDict, deque

from .messages import PartTiming, StepSample, StepTrace

MAX_RECORDS = 65536


class StepTelemetry:
    def __init__(self, max_records: int = MAX_RECORDS):
        self._lock = threading.Lock()
        self._max = max_records
        self._steps: deque[StepSample] = deque(maxlen=max_records)
        self._parts: OrderedDict[str, list] = OrderedDict()   # part id -> [added, first, finished]

    def step(self, start: float, duration: float, plan) -> StepSample:
        pt, pc, nd, dc = plan.batch_shape()
        sample = StepSample(start, duration, pt, pc, nd, dc)
        with self._lock:
            self._steps.append(sample)
        return sample

    def added(self, part_id: str, t: float) -> None:
        with self._lock:
            self._parts[part_id] = [t, None, None]
            while len(self._parts) > self._max:
                self._parts.popitem(last=False)

    def published(self, part_id: str, t: float, *, first_token: bool, finished: bool) -> None:
        with self._lock:
            rec = self._parts.get(part_id)
            if rec is None:
                return
            if first_token and rec[1] is None:
                rec[1] = t
            if finished:
                rec[2] = t

    def take(self, instance_id: str) -> StepTrace:
        with self._lock:
            steps, self._steps = tuple(self._steps), deque(maxlen=self._max)
            parts = tuple(PartTiming(p, *r) for p, r in self._parts.items())
            self._parts = OrderedDict()
        return StepTrace(instance_id, steps, parts)
