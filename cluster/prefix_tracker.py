"""Which instance / node store holds which prompt prefix: the frontend's prefix index, fed by what
the instances and stores report (the router reads it as a ``PrefixIndex``).

    instance poll ──PrefixDelta (cached / evicted since the cursor; full on (re)join or a gap)──┐
    node store poll ──PrefixDelta (stored / evicted)─────────────────────────────────────────────┤
    placement ──in flight: (part, instance, prompt hashes) until that part's first delta─────────┤
                                                                                                 ▼
                                 blocks[h] = (instances, node stores) holding it ──▶ PrefixIndex

Reported entries are the truth as of the last poll (a few hundred ms at most): an evicted block
stops counting, a restarted instance resyncs (a new journal epoch), a removed instance or store
drops out. The one guess kept is the *in-flight* entry: a prompt placed on an instance counts as
held there from placement until that instance's first delta for the part, when its report (read
after the delta) says for sure. Without it, a burst of requests sharing a prefix (a system
prompt, the waves of one Best-of-N) would scatter before any report can show the first one's
blocks. A lost in-flight entry costs one mis-estimated TTFT, never a wrong result.
"""
from __future__ import annotations

from thinkserve.router.snapshot import NO_HOLDERS, NOT_HELD, PrefixIndex
from thinkserve.workers.prefix_journal import START, PrefixCursor, PrefixDelta

INSTANCES, STORES = 0, 1        # the side of a ``blocks`` entry each kind of holder is on

Blocks = dict[int, tuple[frozenset[str], frozenset[str]]]


def _hold(table: Blocks, h: int, side: int, holder: str) -> None:
    entry = table.get(h, NOT_HELD)
    held = entry[side]
    if holder in held:
        return
    held = held | {holder} if held else frozenset((holder,))
    table[h] = (held, entry[1]) if side == INSTANCES else (entry[0], held)


def _release(table: Blocks, h: int, side: int, holder: str) -> None:
    entry = table.get(h)
    if entry is None or holder not in entry[side]:
        return
    held = entry[side]
    held = NO_HOLDERS if len(held) == 1 else held - {holder}
    entry = (held, entry[1]) if side == INSTANCES else (entry[0], held)
    if entry[0] or entry[1]:
        table[h] = entry
    else:
        del table[h]


class _Reports:
    """One kind of holder (instances, or node stores): what each reported, and its cursor."""

    def __init__(self, table: Blocks, side: int):
        self.table = table
        self.side = side
        self.held: dict[str, set[int]] = {}
        self.cursors: dict[str, PrefixCursor] = {}

    def apply(self, holder: str, delta: PrefixDelta, keep=lambda h: False) -> None:
        """``keep(h)``: the holder still counts for ``h`` when its report drops it (in flight)."""
        held = self.held.setdefault(holder, set())
        if delta.full:
            gone, new = held - set(delta.added), [h for h in delta.added if h not in held]
        else:
            gone, new = [h for h in delta.evicted if h in held], [h for h in delta.added if h not in held]
        delta.apply_to(held)
        for h in gone:
            if not keep(h):
                _release(self.table, h, self.side, holder)
        for h in new:
            _hold(self.table, h, self.side, holder)
        self.cursors[holder] = delta.cursor

    def forget(self, holder: str) -> None:
        for h in self.held.pop(holder, ()):
            _release(self.table, h, self.side, holder)
        self.cursors.pop(holder, None)


class PrefixTracker:
    def __init__(self):
        self.blocks: Blocks = {}        # block hash -> (instances, nodes): one table, one lookup per block
        self._instances = _Reports(self.blocks, INSTANCES)
        self._stores = _Reports(self.blocks, STORES)
        self._in_flight: dict[str, tuple[str, tuple[int, ...]]] = {}    # part id -> (instance, hashes)
        self._in_flight_refs: dict[tuple[str, int], int] = {}           # (instance, hash) -> parts

    # ----------------------------------------------------------------- reports
    def instance_cursor(self, instance_id: str) -> PrefixCursor:
        return self._instances.cursors.get(instance_id, START)

    def store_cursor(self, node_id: str) -> PrefixCursor:
        return self._stores.cursors.get(node_id, START)

    def reported(self, instance_id: str) -> frozenset[int] | None:
        """What the instance's reports say its prefix cache holds (None: it never reported)."""
        held = self._instances.held.get(instance_id)
        return None if held is None else frozenset(held)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def instance_reported(self, instance_id: str, delta: PrefixDelta) -> None:
        self._instances.apply(instance_id, delta, lambda h: (instance_id, h) in self._in_flight_refs)

    def store_reported(self, node_id: str, delta: PrefixDelta) -> None:
        self._stores.apply(node_id, delta)

    # ----------------------------------------------------------------- in flight
    def in_flight(self, part_id: str, instance_id: str, hashes: tuple[int, ...]) -> None:
        """``part_id`` will prefill a prompt with these block hashes on ``instance_id``."""
        if not hashes or part_id in self._in_flight:
            return
        self._in_flight[part_id] = (instance_id, hashes)
        for h in hashes:
            key = (instance_id, h)
            self._in_flight_refs[key] = self._in_flight_refs.get(key, 0) + 1
            _hold(self.blocks, h, INSTANCES, instance_id)

    def settled(self, part_id: str) -> None:
        """The instance reported after this part's prefill (or the part is gone): its report alone
        says from now on."""
        entry = self._in_flight.pop(part_id, None)
        if entry is None:
            return
        instance_id, hashes = entry
        reported = self._instances.held.get(instance_id, ())
        for h in hashes:
            key = (instance_id, h)
            left = self._in_flight_refs[key] - 1
            if left:
                self._in_flight_refs[key] = left
                continue
            del self._in_flight_refs[key]
            if h not in reported:
                _release(self.blocks, h, INSTANCES, instance_id)

    # ----------------------------------------------------------------- holders leaving
    def forget_instance(self, instance_id: str) -> None:
        """Removed, lost or restarted under a new id: none of its entries count any more."""
        for part_id in [p for p, (iid, _) in self._in_flight.items() if iid == instance_id]:
            self.settled(part_id)
        self._instances.forget(instance_id)

    def forget_node(self, node_id: str) -> None:
        """Its store is gone (or unreachable): nothing counts there until it reports again."""
        self._stores.forget(node_id)

    def index(self) -> PrefixIndex:
        """A view for one placement (read while the event loop runs nothing else)."""
        return PrefixIndex(self.blocks)
