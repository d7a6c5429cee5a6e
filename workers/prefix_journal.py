"""Which prefix blocks a cache holds, as versioned deltas a remote reader can follow.

The router places a prompt where its prefix is cached, so it must know what each engine's prefix
cache and each node's CPU KV store hold *now*, evictions included (an index built from what the
router itself sent goes stale at the first eviction or restart). Both caches record here every
block hash they start or stop holding; a reader keeps a ``PrefixCursor`` and asks for what
changed since, in the manner of vLLM's KV events (BlockStored / BlockRemoved) that Dynamo's and
llm-d's KV-aware routers consume, but pulled with the stats poll, so a lost reply costs nothing:

    cache: add h1, add h2, evict h1, add h3        reader at (epoch E, version 1)
    journal: E, events v1..v4                ──▶   PrefixDelta(E, 4, added=(h2, h3), evicted=(h1,))
    reader with another epoch (the cache restarted) or one older than the events kept
                                             ──▶   PrefixDelta(E, 4, full=True, added=<everything held>)

Pure Python: the engine's block manager and the CPU KV store both use it.
"""
from __future__ import annotations

import os
import threading
from collections import deque
from itertools import islice
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixCursor:
    """How far a reader has followed a journal. Another ``epoch`` means another journal (the
    cache restarted): the reader gets a full resync."""

    epoch: str = ""
    version: int = 0


START = PrefixCursor()      # a reader that knows nothing yet: the first answer is a full resync


@dataclass(frozen=True)
class PrefixDelta:
    """Block hashes a cache started (``added``) or stopped (``evicted``) holding since the reader's
    cursor; with ``full``, ``added`` is everything it holds and the reader drops what it had."""

    epoch: str
    version: int
    full: bool = False
    added: tuple[int, ...] = ()
    evicted: tuple[int, ...] = ()

    @property
    def cursor(self) -> PrefixCursor:
        return PrefixCursor(self.epoch, self.version)

    def apply_to(self, held: set[int]) -> None:
        """Bring a reader's copy of the holder's set up to this delta (in place)."""
        if self.full:
            held.clear()
        held.difference_update(self.evicted)
        held.update(self.added)


class PrefixJournal:
    """The set of prefix block hashes one cache holds, and the last ``max_events`` changes to it.
    Thread-safe on its own lock, so a reader (the instance's poll) need not wait for the cache's
    owner (an engine step) to read what changed."""

    def __init__(self, max_events: int = 1 << 16):
        self.epoch = os.urandom(8).hex()
        self.max_events = max(1, max_events)
        self.version = 0
        self.held: set[int] = set()
        self._events: deque[tuple[int, bool]] = deque()   # (hash, added), versions version-len+1 .. version
        self._lock = threading.Lock()

    def added(self, h: int) -> None:
        with self._lock:
            if h not in self.held:
                self.held.add(h)
                self._record(h, True)

    def evicted(self, h: int) -> None:
        with self._lock:
            if h in self.held:
                self.held.discard(h)
                self._record(h, False)

    def _record(self, h: int, added: bool) -> None:
        self.version += 1
        self._events.append((h, added))
        if len(self._events) > self.max_events:
            self._events.popleft()

    def since(self, cursor: PrefixCursor) -> PrefixDelta:
        """What changed after ``cursor``: the net change per hash, or everything (``full``) when the
        cursor is from another epoch or older than the oldest event kept."""
        with self._lock:
            return self._since(cursor)

    def _since(self, cursor: PrefixCursor) -> PrefixDelta:
        behind = self.version - cursor.version
        if cursor.epoch != self.epoch or behind < 0 or behind > len(self._events):
            return PrefixDelta(self.epoch, self.version, True, tuple(self.held))
        if behind == 0:
            return PrefixDelta(self.epoch, self.version)
        touched = {h for h, _ in islice(reversed(self._events), behind)}
        added = tuple(h for h in touched if h in self.held)
        evicted = tuple(h for h in touched if h not in self.held)
        return PrefixDelta(self.epoch, self.version, False, added, evicted)
