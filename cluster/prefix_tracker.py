"""Which instance / node store holds which prompt prefix, as far as the frontend can tell.

Instances and stores do not report their cached block hashes, so the frontend keeps an
approximate index from what it did itself (SGLang's router keeps such an approximate tree too):
a prompt prefilled on instance X leaves its full blocks in X's prefix cache; its handoff
publishes them to X's node store. Evictions there are not seen, so entries age out LRU
(``max_hashes``); a stale entry costs one mis-estimated TTFT, never a wrong result.
"""
from __future__ import annotations

from collections import OrderedDict

from thinkserve.router.snapshot import PrefixIndex


class PrefixTracker:
    def __init__(self, max_hashes: int = 65536):
        self.max_hashes = max_hashes
        self.on_instance: OrderedDict[int, frozenset[str]] = OrderedDict()
        self.in_store: OrderedDict[int, frozenset[str]] = OrderedDict()

    def _add(self, table: OrderedDict, holder: str, hashes: tuple[int, ...]) -> None:
        for h in hashes:
            held = table.get(h, frozenset())
            table[h] = held | {holder} if holder not in held else held
            table.move_to_end(h)
        while len(table) > self.max_hashes:
            table.popitem(last=False)

    def prefilled(self, instance_id: str, hashes: tuple[int, ...]) -> None:
        self._add(self.on_instance, instance_id, hashes)

    def published(self, node_id: str, hashes: tuple[int, ...]) -> None:
        self._add(self.in_store, node_id, hashes)

    def forget_instance(self, instance_id: str) -> None:
        for h, held in list(self.on_instance.items()):
            if instance_id in held:
                rest = held - {instance_id}
                if rest:
                    self.on_instance[h] = rest
                else:
                    del self.on_instance[h]

    def index(self) -> PrefixIndex:
        """A view for one placement (read while the event loop runs nothing else)."""
        return PrefixIndex(self.on_instance, self.in_store)
